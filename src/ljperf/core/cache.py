"""ljperf's on-disk cache: ``$LJPERF_CACHE_DIR`` (default ``~/.cache/ljperf``).

Traced forecast coefficients (``forecast/``), resolved model configs (``models/``) and the CUDA calibration
(``calibration.json``) live there; deleting it costs only time. Each entry is stored with a SHA-256 of its content
(``{"ljperf_sha256": ..., "data": ...}``): an entry changed since ljperf wrote it (a number scaled, a string for a
number) is made again, with one warning line, never read as true and never a traceback.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Generator
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
    cache that cannot be written is only slower). Processes that miss the same entry at once (the ranks of a
    node, a job's concurrent plans) make it once: the first makes it, the others wait for it and read it."""
    before = _stamp(path)
    if (found := _load(path, load)) is not None:
        return found[0]
    with _making(path):
        if _stamp(path) != before and (found := _load(path, load)) is not None:  # made while this one waited
            return found[0]
        value = make()
        data = json.loads(json.dumps(dump(value), default=str))  # as it reads back: tuples are lists
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # NaN kept as NaN (a config's own, say): a null read back would never match the signature
            write_json(path, {SIGNATURE: digest(data), "data": data}, strict=False)
        except OSError as exc:
            _cannot_write(exc)
    return value


_told: list[str] = []
"""The cache root this process said it cannot use (said once: every entry would say it again)."""


def _cannot_write(exc: OSError) -> None:
    root = str(cache_root())
    if root in _told:
        return
    _told.append(root)
    why = "it is a file, not a folder" if os.path.isfile(root) else exc.strerror or str(exc)
    warn(f"the cache {root} cannot be used ({why}): each forecast traces again; set LJPERF_CACHE_DIR to a folder")


def _load(path: Path, load: Callable[[Any], T]) -> tuple[T] | None:
    """``(load(entry),)`` of a sound entry at ``path``, else None."""
    try:
        stored = read_json(path)
        if isinstance(stored, dict) and stored.keys() == {SIGNATURE, "data"}:
            if stored[SIGNATURE] == digest(stored["data"]):
                return (load(stored["data"]),)
            warn(f"cache entry {path} changed since ljperf wrote it: made again")
    except Exception:
        pass
    return None


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ino


@contextlib.contextmanager
def _making(path: Path) -> Generator[None, None, None]:
    """An exclusive lock on making ``path`` across processes (``flock`` of a file under the cache root's
    ``locks/``, released by the kernel if the process dies); no lock where none can be taken."""
    lock = cache_root() / "locks" / f"{hashlib.sha256(str(path.absolute()).encode()).hexdigest()[:32]}.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
