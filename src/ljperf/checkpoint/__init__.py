"""Activation checkpointing: per-layer plans (none / selective / full), applied to any model, and the solver
that picks the fastest plan fitting a memory budget.

Run: ``ljperf benchmark --model torch/llama-tiny --recompute auto``; or ``CHECKPOINT_OPTIMIZATION=true`` with
an unchanged HF Trainer or DeepSpeed script (docs/checkpoint.md).
"""

from ljperf.errors import UsageError

MODES = ("none", "selective", "full")
"""Per-layer activation recomputation: keep everything, op-level SAC, or keep only the layer input."""


def parse_recompute(value: str) -> str | int | tuple[str, ...]:
    """``--recompute``: ``none``, ``selective``, ``full`` (every layer), ``auto``, K (the first K layers full)
    or one mode per layer (``full,selective,none,...``)."""
    if value in (*MODES, "auto"):
        return value
    if "," in value:
        modes = tuple(m.strip() for m in value.split(","))
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise UsageError(f"--recompute {value!r}: {bad[0]!r} is not one of {', '.join(MODES)}")
        return modes
    try:
        k = int(value)
    except ValueError:
        raise UsageError(
            f"--recompute {value!r}: choose none, selective, full, auto, a layer count K or MODE,MODE,..."
        ) from None
    if k < 0:
        raise UsageError(f"--recompute {k}: K must be zero or more")
    return k
