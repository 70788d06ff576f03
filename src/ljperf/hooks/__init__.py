"""Startup hooks: optimizations switched on by an environment variable, with no change to the user's script.

Run: ``CHECKPOINT_OPTIMIZATION=true python train.py`` (docs/checkpoint.md). Installing ljperf puts
``ljperf_startup.pth`` in site-packages; its one line checks the variables and imports nothing unless one is
set. ``startup.HOOKS`` maps each variable to the module whose ``register()`` installs that hook, and
``imports.when_imported`` patches a library only when (and if) the user's script imports it.
"""
