"""The environment variables that switch ljperf's startup hooks on, and how their values read.

Run: ``enabled("CHECKPOINT_OPTIMIZATION")``: True for 1/true/yes/on; a value that is neither warns once.
"""

from __future__ import annotations

import os
import sys

HOOKS = {
    "CHECKPOINT_OPTIMIZATION": "ljperf.startup_hooks.checkpoint",
    "COMPILE_OPTIMIZATION": "ljperf.startup_hooks.compile_trainer",
}
"""Environment variable → module whose ``register()`` installs the hook
(``startup_hooks.post_import.when_imported``)."""

ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")
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
