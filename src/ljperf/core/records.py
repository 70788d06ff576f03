"""Result records: one JSON object per run, written atomically; schema in docs/results.md.

The ``env`` section is an allow-list (versions, devices, world size, selected NCCL_/CUDA_ variables):
never a dump of the environment, so tokens and keys cannot leak into result files.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import math
import os
import platform
import re
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from ljperf import __version__
from ljperf.core.errors import UsageError

SCHEMA_VERSION = 1
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "triton")
# Variables that shape a run's performance and carry no secrets.
ENV_VARIABLES = re.compile(
    r"^(NCCL_(SOCKET_IFNAME|IB_HCA|DEBUG|ALGO|PROTO|P2P_LEVEL|NET_GDR_LEVEL|MIN_NCHANNELS|MAX_NCHANNELS|"
    r"BUFFSIZE|NVLS_ENABLE|CUMEM_ENABLE)|CUDA_VISIBLE_DEVICES|CUDA_DEVICE_MAX_CONNECTIONS|"
    r"PYTORCH_CUDA_ALLOC_CONF|OMP_NUM_THREADS|CHECKPOINT_OPTIMIZATION|COMPILE_OPTIMIZATION|LJPERF_MEMORY_BUDGET)$"
)
_SECRET_WORDS = re.compile(r"TOKEN|SECRET|PASSWORD|KEY|CREDENTIAL", re.IGNORECASE)
_SECRET_KEY = re.compile(
    r"(^|[_.\-])(api_?key|key|token|secret|password|passwd|credentials?|auth|authorization|private_key)([_.\-]|$)",
    re.IGNORECASE,
)
REDACTED = "<redacted>"


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def installed_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """The installed version of each distribution, None where it is not installed."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def versions() -> dict[str, str | None]:
    # ljperf's is the code that runs, also from a source tree on PYTHONPATH with no distribution installed
    return {"python": platform.python_version(), **installed_versions(PACKAGES), "ljperf": __version__}


def selected_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if ENV_VARIABLES.match(k) and not _SECRET_WORDS.search(k)}


def without_secrets(value: Any) -> Any:
    """``value`` (a config: dicts, lists, scalars) with the value of every key that names a credential (``api_key``,
    ``token``, ``secret``, ``password``, ...) at any depth replaced by ``REDACTED``: what a record may hold of a
    user's file (a DeepSpeed config's ``comet``/``wandb`` sections carry API keys)."""
    if isinstance(value, dict):
        return {k: REDACTED if _SECRET_KEY.search(str(k)) else without_secrets(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_secrets(v) for v in value]
    return value


def git_revision() -> str | None:
    """The git revision of the working directory's checkout, if any (the user's project, or ljperf's)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(*, devices: list[str], world_size: int) -> dict[str, Any]:
    """The ``env`` section of a record."""
    return {
        "versions": versions(),
        "host": platform.node(),
        "platform": platform.platform(),
        "devices": devices,
        "world_size": world_size,
        "variables": selected_env(),
        "git_revision": git_revision(),
    }


def record_header(kind: str, *, args: list[str], devices: list[str], world_size: int) -> dict[str, Any]:
    """What every record starts with: schema version, kind, start time, command line and environment."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "start_time": now_iso(),
        "args": args,
        "env": environment(devices=devices, world_size=world_size),
    }


STDOUT = "-"
"""``--output -``: the record goes to standard output (and what ljperf prints for people, to standard error)."""


def check_writable(
    path: str | os.PathLike, *, what: str = "--output", inputs: tuple[str | os.PathLike | None, ...] = ()
) -> None:
    """Fail before a run starts (exit 2) when its result file could not be written (``what`` names the flag): a
    missing folder, a folder, a device node, FIFO or other file that is not a regular one (a symlink counts as
    what it points to), or one of the run's ``inputs`` (a ``--deepspeed-config`` the record would overwrite)."""
    if str(path) == STDOUT:
        return
    if not str(path).strip():
        raise UsageError(f"{what} is empty; give a file name such as result.json")
    target = Path(os.path.realpath(path))
    shown = repr(str(path))
    if target.is_dir():
        raise UsageError(f"{what} {shown} is a directory; give a file name such as result.json")
    kind = _kind(path)
    if kind is not None:
        raise UsageError(f"{what} {shown} is {kind}, not a file: give a file name such as result.json, or - for stdout")
    if any(source is not None and Path(os.path.realpath(source)) == target for source in inputs):
        raise UsageError(f"{what} {shown} is one of the run's input files: the record would overwrite it")
    if not target.parent.is_dir():
        raise UsageError(f"{what} {shown}: folder {str(Path(path).parent)!r} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".ljperf-probe-", delete=True) as f:
            f.write(b"x" * 65536)  # about the size of a long run's record
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise UsageError(f"{what} {shown} is not writable ({exc.strerror or exc})") from None


def check_distinct_outputs(
    files: dict[str, str | os.PathLike | None], *, folders: dict[str, tuple[str | os.PathLike | None, tuple[str, ...]]]
) -> None:
    """Fail before a run starts (exit 2) when two of a command's outputs resolve to one file: ``files`` by flag
    (``--output``, ``--plot``), ``folders`` by flag as (folder, the names written into it) (``--profile``). The one
    written last would replace the other (a picture over the JSON record)."""
    seen: dict[Path, tuple[str, str]] = {}
    for flag, path in files.items():
        if path is None or str(path) == STDOUT:
            continue
        target = Path(os.path.realpath(path))
        if target in seen:
            raise UsageError(f"{seen[target][0]} and {flag} name the same file {str(path)!r}: give each its own")
        seen[target] = (flag, str(path))
    for flag, (folder, names) in folders.items():
        if folder is None:
            continue
        root = Path(os.path.realpath(folder))
        for target, (other, given) in seen.items():
            if target == root or (target.parent == root and any(target.match(name) for name in names)):
                raise UsageError(f"{other} {given!r} is in {flag} {str(folder)!r}, where the run writes its own files")


def check_output_folder(path: str | os.PathLike, *, what: str, file_name: str) -> None:
    """Fail before a run starts (exit 2) when ``file_name`` could not be written into the folder ``path`` (``what``
    names the flag); a missing folder is made, as ``mkdir -p`` would."""
    shown = repr(str(path))
    if not str(path).strip():
        raise UsageError(f"{what} is empty; give a folder name such as prof/")
    if Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"{what} {shown} is a file, not a folder")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{what} {shown}: cannot make the folder ({exc.strerror or exc})") from None
    check_writable(Path(path) / file_name, what=what)


def _kind(path: str | os.PathLike) -> str | None:
    """What an existing path that is not a regular file is, in words (through symlinks); None for a regular file
    or nothing there."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO or pipe"), (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once, at import: os.umask can only be read by setting it


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """Write a file atomically: ``write`` fills a temporary file in the same folder, fsync, then rename over
    ``path`` (with the mode a plain ``open`` gives: mkstemp's own is 0600); a symlink's target is written, the link
    stays. ``-`` writes to standard output."""
    if str(path) == STDOUT:
        sys.stdout.flush()
        write(sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return
    target = Path(os.path.realpath(path))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, data: Any, *, strict: bool = True) -> None:
    """Write JSON atomically (``write_atomic``); a float that is not finite (a diverged loss) is ``null``, as
    strict JSON has no NaN, unless ``strict=False`` (a cache entry, read back by ljperf alone: Python's ``NaN``)."""
    try:
        text = json.dumps(data, indent=2, default=str, allow_nan=not strict)
    except ValueError:  # rare: walked only then
        text = json.dumps(_finite(data), indent=2, default=str, allow_nan=False)
    write_atomic(path, lambda f: f.write((text + "\n").encode()))


def _finite(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(v) for v in data]
    return data


CONFIG_LIMIT = 8 * 1024**2
"""Bytes of a JSON file a user names (a model or DeepSpeed config: a few KiB)."""
RECORD_LIMIT = 256 * 1024**2
"""Bytes of a JSON file ljperf wrote (a record of 10^6 steps is about 40 MB)."""


class JSONInputError(ValueError):
    """A JSON file that is not one ljperf reads: not a regular file, too large, not JSON, or nested too deep."""


def read_json(path: str | os.PathLike, *, limit: int = RECORD_LIMIT) -> Any:
    """The JSON value of a regular file of at most ``limit`` bytes; never pickle. A device (``/dev/zero``: read until
    memory ran out), a FIFO (blocked for ever), a larger file, malformed or too deeply nested JSON (a
    ``RecursionError``) raise ``JSONInputError``; a missing or unreadable file the ``OSError``."""
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    kind = _kind(path)
    if kind is not None:
        raise JSONInputError(f"it is {kind}" + (", not a file" if kind.startswith("a ") else ""))
    size = os.stat(path).st_size
    if size > limit:
        raise JSONInputError(f"it is {format_size(size)}, more than the {format_size(limit)} a JSON input may be")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    try:
        return json.loads(data)
    except RecursionError:
        raise JSONInputError("it is nested deeper than Python reads") from None
    except UnicodeDecodeError:
        raise JSONInputError("it is not text") from None
    except json.JSONDecodeError as exc:
        raise JSONInputError(f"it is not valid JSON (line {exc.lineno}: {exc.msg})") from None


def read_json_object(path: str | os.PathLike, *, what: str) -> dict:
    """A JSON object from a file the user named (``what``, e.g. ``--model-config 'x.json'``); a missing, unreadable,
    malformed or oversized file, or one that holds no object, is a usage error naming it."""
    try:
        data = read_json(path, limit=CONFIG_LIMIT)
    except FileNotFoundError:
        raise UsageError(f"{what}: no such file") from None
    except JSONInputError as exc:
        raise UsageError(f"{what}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{what}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{what} must hold a JSON object")
    return data


def format_size(n: int) -> str:
    """Bytes as MiB, for the size errors above (``core.units`` formats for tables)."""
    return f"{n / 1024**2:.1f} MiB"
