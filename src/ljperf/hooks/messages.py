"""What the startup hooks say: one ``[ljperf]`` line on rank 0 (or on the rank that alone did it), and warnings
pointed at the user's own script.

Run: ``log("recomputing 4/6 layers ...")``, ``warn("...")`` from a hook.
"""

from __future__ import annotations

import os
import sys
import warnings

PREFIX = "[ljperf]"


def is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def log(line: str, *, rank_local: bool = False) -> None:
    """Print ``line`` on rank 0; a ``rank_local`` line (what this rank alone did) on every rank, after its rank."""
    if is_main():
        print(f"{PREFIX} {line}", file=sys.stderr, flush=True)
    elif rank_local:
        print(f"{PREFIX} rank {os.environ['RANK']}: {line}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """Warn at the script's own line: the first caller outside ljperf, installed packages and the standard
    library (the hook runs under torch's module call and ``dynamo.disable``, whose lines a warning showed)."""
    import sysconfig

    paths = sysconfig.get_paths()
    library = (os.path.dirname(os.path.dirname(__file__)), paths["stdlib"], paths["purelib"], paths["platlib"], "<")
    frame, level = sys._getframe(1), 2
    while frame is not None and (
        frame.f_code.co_filename.startswith(library) or f"{os.sep}site-packages{os.sep}" in frame.f_code.co_filename
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level if frame is not None else 2)
