"""What ``ljperf_startup.pth`` calls when one of the variables in ``HOOKS`` is set: each enabled hook's
``register()``. A hook that fails to register warns once; the interpreter starts as usual.

To add a hook: one line in ``HOOKS`` (variable → module with ``register()``), the variable in the ``.pth``.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

HOOKS = {
    "CHECKPOINT_OPTIMIZATION": "ljperf.hooks.checkpoint",
    "COMPILE_OPTIMIZATION": "ljperf.hooks.compile_trainer",
}
"""Environment variable → module whose ``register()`` installs the hook (``imports.when_imported``)."""


ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")
_installed: set[str] = set()
_warned: set[str] = set()


def enabled(variable: str) -> bool:
    """Whether ``variable`` turns its hook on; a value that is neither on nor off warns once and counts as off."""
    value = os.environ.get(variable, "").strip().lower()
    # One warning per node: every rank of a job reads the same variable.
    if value not in ON + OFF and variable not in _warned and os.environ.get("LOCAL_RANK", "0") == "0":
        _warned.add(variable)
        print(
            f"ljperf: warning: {variable}={os.environ[variable]!r} is neither on ({', '.join(ON)}) nor off"
            f" ({', '.join(OFF[1:])}): the hook stays off",
            file=sys.stderr,
        )
    return value in ON


def install() -> None:
    """Register each enabled hook once (a ``.pth`` can run twice, e.g. from two site directories)."""
    for variable, module in HOOKS.items():
        if variable in _installed or not enabled(variable):
            continue
        _installed.add(variable)
        try:
            importlib.import_module(module).register()
        except Exception as exc:
            warnings.warn(f"ljperf: {variable} is set but its hook failed to load ({exc!r})", stacklevel=2)
