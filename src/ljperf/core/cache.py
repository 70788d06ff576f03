"""ljperf's on-disk cache: ``$LJPERF_CACHE_DIR`` (default ``~/.cache/ljperf``).

Traced forecast coefficients (``forecast/``), resolved model configs (``models/``) and the CUDA calibration
(``calibration.json``) live there; deleting it costs only time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ljperf.core.records import read_json, write_json

T = TypeVar("T")


def cache_root() -> Path:
    return Path(os.environ.get("LJPERF_CACHE_DIR") or Path.home() / ".cache" / "ljperf")


def cached(path: Path, *, load: Callable[[Any], T], make: Callable[[], T], dump: Callable[[T], Any]) -> T:
    """``load`` of the JSON file at ``path``; when it is missing, unreadable or damaged, ``make()``, saved there
    through ``dump`` (a cache that cannot be written is only slower)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return load(read_json(path))
    value = make()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, dump(value))
    return value
