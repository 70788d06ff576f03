"""What the startup hooks say: one ``[ljperf]`` line on stderr, on rank 0 (or on the rank that alone did it);
a warning is such a line too.

Run: ``log("recomputing 4/6 layers ...")``, ``warn("...")`` from a hook.
"""

from __future__ import annotations

import os
import sys

PREFIX = "[ljperf]"


def is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def log(line: str, *, rank_local: bool = False) -> None:
    """Print ``line`` on rank 0; a ``rank_local`` line (what this rank alone did) on every rank, after its rank."""
    if is_main():
        print(f"{PREFIX} {line}", file=sys.stderr, flush=True)
    elif rank_local:
        print(f"{PREFIX} rank {os.environ['RANK']}: {line}", file=sys.stderr, flush=True)


def warn(message: str, *, rank_local: bool = False) -> None:
    """``log`` a warning: one ``[ljperf] warning: ...`` line on stderr, not a Python warning, which pointed into
    the script's or torch's lines and which a script's ``warnings.simplefilter("ignore")`` hid."""
    log(f"warning: {message}", rank_local=rank_local)
