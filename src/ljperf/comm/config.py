"""What ``ljperf comm`` times: the collectives, the message sizes and the iterations (nccl-tests' bus bandwidth
factors: ``speed.collectives.BUS_FACTOR``, which the step-time model prices collectives with too).

Run: ``CommConfig(ops="all_reduce", max_bytes="1G").sizes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ljperf.core.choices import Device, values_of
from ljperf.core.errors import UsageError
from ljperf.core.options import check_values, not_negative, opt, positive
from ljperf.core.units import parse_size
from ljperf.speed.collectives import BUS_FACTOR

OPS = tuple(BUS_FACTOR)
CommDtype = Literal["float32", "bfloat16", "float16"]
"""The element types ``ljperf comm`` times (torch's names)."""
DTYPE_NAMES: tuple[CommDtype, ...] = values_of(CommDtype)
DEFAULT_MIN_BYTES = "1K"


@dataclass(kw_only=True)
class CommConfig:
    """Which collectives to time, at which sizes, how often."""

    TITLE: ClassVar[str] = "collectives"

    ops: str = opt("all", f"comma-separated collectives ({', '.join(OPS)}) or all", metavar="OP[,OP]")
    min_bytes: str | None = opt(
        None,
        f"smallest message (nccl-tests -b; default: {DEFAULT_MIN_BYTES}, or --max-bytes when smaller); "
        "K/M/G are binary, KB/MB/GB decimal",
        metavar="SIZE",
    )
    max_bytes: str = opt("64M", "largest message (nccl-tests -e)", metavar="SIZE")
    step_factor: int = opt(2, "multiply the size by this from --min-bytes to --max-bytes (nccl-tests -f)")
    iters: int = opt(20, "timed iterations per size (nccl-tests -n)")
    warmup_iters: int = opt(5, "untimed iterations per size before timing (nccl-tests -w)")
    dtype: CommDtype = opt("float32", "element type: {values}")
    device: Device = opt("auto", "{values}", values={"cpu": "gloo", "cuda": "NCCL", "auto": "cuda when available"})
    check: bool = opt(True, "verify one iteration per size (the #wrong column)")
    op_list: list[str] = field(init=False, default_factory=list)
    """The collectives, resolved from ``ops``."""
    sizes: list[int] = field(init=False, default_factory=list)
    """The sizes in bytes, resolved from ``min_bytes``, ``max_bytes`` and ``step_factor``."""

    def __post_init__(self) -> None:
        names = [o.strip() for o in self.ops.split(",") if o.strip()]
        unknown = [o for o in names if o not in (*OPS, "all")]
        if unknown or not names:
            raise UsageError(f"--ops {self.ops!r}: choose from {', '.join(OPS)} or all")
        self.op_list = list(OPS) if "all" in names else list(dict.fromkeys(names))
        high = parse_size(self.max_bytes, what="--max-bytes")
        if self.min_bytes is None:  # a max below the default min asks for small sizes, not for an error
            self.min_bytes = DEFAULT_MIN_BYTES if parse_size(DEFAULT_MIN_BYTES) <= high else self.max_bytes
        low = parse_size(self.min_bytes, what="--min-bytes")
        if low > high:
            raise UsageError(f"--min-bytes {self.min_bytes} is larger than --max-bytes {self.max_bytes}")
        if self.step_factor < 2:
            raise UsageError(f"--step-factor must be 2 or more (got {self.step_factor})")
        positive("iters", self.iters)
        not_negative("warmup_iters", self.warmup_iters)
        check_values(self)
        self.sizes = [low]
        while self.sizes[-1] * self.step_factor <= high:
            self.sizes.append(self.sizes[-1] * self.step_factor)
