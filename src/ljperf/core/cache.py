"""ljperf's on-disk cache: ``$LJPERF_CACHE_DIR`` (default ``~/.cache/ljperf``).

Traced forecast coefficients (``forecast/``), resolved model configs (``models/``) and the CUDA calibration
(``calibration.json``) live there; deleting it costs only time. Each entry is stored with a SHA-256 of its content
(``{"ljperf_sha256": ..., "data": ...}``): an entry changed since ljperf wrote it (a number scaled, a string for a
number) is made again, with one warning line, never read as true and never a traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ljperf.core.console import warn
from ljperf.core.records import read_json, write_json

T = TypeVar("T")


def cache_root() -> Path:
    return Path(os.environ.get("LJPERF_CACHE_DIR") or Path.home() / ".cache" / "ljperf")


SIGNATURE = "ljperf_sha256"


def digest(data: Any) -> str:
    """SHA-256 of ``data`` as canonical JSON (what a written entry reads back as)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def cached(path: Path, *, load: Callable[[Any], T], make: Callable[[], T], dump: Callable[[T], Any]) -> T:
    """``load`` of the entry at ``path``; when it is missing, unreadable, unsigned (an older ljperf's), changed
    since it was written (one warning) or otherwise damaged, ``make()``, saved there signed through ``dump`` (a
    cache that cannot be written is only slower)."""
    try:
        stored = read_json(path)
        if isinstance(stored, dict) and stored.keys() == {SIGNATURE, "data"}:
            if stored[SIGNATURE] == digest(stored["data"]):
                return load(stored["data"])
            warn(f"cache entry {path} changed since ljperf wrote it: made again")
    except FileNotFoundError:
        pass
    except Exception:
        pass
    value = make()
    data = json.loads(json.dumps(dump(value), default=str))  # as it reads back: tuples are lists
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {SIGNATURE: digest(data), "data": data})
    return value
