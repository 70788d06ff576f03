"""Startup hooks: optimizations switched on by an environment variable, with no change to the user's script.

Run: ``CHECKPOINT_OPTIMIZATION=true python train.py`` (docs/checkpoint.md). Installing ljperf puts
``ljperf_startup.pth`` in site-packages; its one line checks the variables and, when one is set, has
``imports.boot`` wait (importing nothing else) for the script's first import of transformers' Trainer, DeepSpeed or
FSDP2; then ``startup.install`` registers each enabled hook of ``core.switches.HOOKS``, and ``imports.when_imported``
patches a library only when (and if) the script imports it.
"""
