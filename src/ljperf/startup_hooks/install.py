"""What ``ljperf_startup.pth`` calls when one of the variables in ``core.switches.HOOKS`` is set: each enabled
hook's ``register()``. A hook that fails to register warns once; the interpreter starts as usual.

To add a hook: one line in ``HOOKS`` (variable → module with ``register()``), the variable in the ``.pth``.
"""

from __future__ import annotations

import importlib
import sys

from ljperf.core.switches import HOOKS, enabled

_installed: set[str] = set()


def install() -> None:
    """Register each enabled hook once (a ``.pth`` can run twice, e.g. from two site directories)."""
    for variable, module in HOOKS.items():
        if variable in _installed or not enabled(variable):
            continue
        _installed.add(variable)
        try:
            importlib.import_module(module).register()
        except Exception as exc:
            print(f"[ljperf] warning: {variable} is set but its hook failed to load ({exc!r})", file=sys.stderr)
