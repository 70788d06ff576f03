"""Byte sizes as people write them: ``70GiB``, ``80GB``, ``512MiB``, ``1K``, plain bytes."""

import re

from ljperf.core.errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1000,
    "KIB": 1024,
    "M": 1024**2,
    "MB": 1000**2,
    "MIB": 1024**2,
    "G": 1024**3,
    "GB": 1000**3,
    "GIB": 1024**3,
    "T": 1024**4,
    "TB": 1000**4,
    "TIB": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")
LARGEST_SIZE = 2**60
"""1 EiB: more than any machine holds, and within an int64 (a 400-digit size overflowed float → int)."""


def parse_size(text: str, *, what: str = "size") -> int:
    """Parse ``text`` into bytes. Bare K/M/G are binary (as nccl-tests reads them); KB/MB/GB decimal."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(f"{what} {_shown(text)} is not a size: write e.g. 80GiB, 70GB, 512MiB or 1K")
    number = float(match.group(1)) * _UNITS[unit]
    if number > LARGEST_SIZE:
        raise UsageError(f"{what} {_shown(text)} is larger than 1 EiB: write a size a machine has, e.g. 80GiB")
    value = int(number)
    if value <= 0:
        raise UsageError(f"{what} {text!r} must be larger than zero")
    return value


def _shown(text: str) -> str:
    """``text`` quoted for a one-line error, cut to 40 characters."""
    return repr(text) if len(text) <= 40 else repr(text[:40]) + "…"


def parse_memory(text: str, *, what: str) -> int:
    """A memory size (a device's, a budget) as ``parse_size`` reads it; a bare number under 1 MiB is refused:
    ``--gpu-memory 80`` means 80 GB to a person, not 80 bytes."""
    value = parse_size(text, what=what)
    if value < 1024**2 and (match := _SIZE.match(text)) is not None and not match.group(2):
        raise UsageError(f"{what} {text!r} is {value} bytes: write a unit, e.g. {text.strip()}GiB")
    return value


_BINARY = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def unit_of(n: float) -> tuple[str, int]:
    """The largest binary unit ``n`` is at least one of (bytes below 1 KiB)."""
    return next(((unit, scale) for unit, scale in _BINARY if abs(n) >= scale), ("B", 1))


def format_bytes(n: float | None) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``; ``-`` for None."""
    if n is None:
        return "-"
    unit, scale = unit_of(n)
    return f"{int(n)} B" if unit == "B" else f"{n / scale:.2f} {unit}"


def format_part(part: float, whole: float) -> str:
    """``71.2 of 72.0 GiB``; ``21.30 MiB of 1.00 KiB`` when one unit does not suit both."""
    if unit_of(part) != (unit_scale := unit_of(whole)):
        return f"{format_bytes(part)} of {format_bytes(whole)}"
    unit, scale = unit_scale
    return f"{part / scale:.1f} of {whole / scale:.1f} {unit}"
