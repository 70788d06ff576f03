"""Recompute plans as values: ``--recompute`` parsed, and one mode per decoder layer (none / selective / full).

Run: ``parse_recompute("2")`` → 2; ``fixed_plan(2, 4)`` → ``("full", "full", "none", "none")``. The engines apply a
plan (``ljperf.checkpoint``), the solver picks one (``ljperf.recompute``); neither is needed to read or print one.
"""

from collections.abc import Sequence

from ljperf.core.errors import UsageError

MODES = ("none", "selective", "full")
"""Per-layer activation recomputation: keep everything, op-level SAC, or keep only the layer input."""

Plan = tuple[str, ...]
"""One mode per layer, in layer order."""


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


def fixed_plan(value: str | int | tuple[str, ...], layers: int) -> Plan:
    """The plan of ``--recompute none|selective|full|K|MODE,...`` (parsed) for a model of ``layers`` layers."""
    if value in ("none", "selective", "full"):
        return (value,) * layers
    if isinstance(value, tuple):
        if len(value) != layers:
            raise UsageError(f"--recompute lists {len(value)} modes but the model has {layers} layers")
        return value
    if isinstance(value, int):
        if value > layers:
            raise UsageError(f"--recompute {value}: the model has only {layers} layers")
        return ("full",) * value + ("none",) * (layers - value)
    raise ValueError(f"no fixed plan for --recompute {value!r}")


def summary(plan: Sequence[str]) -> str:
    """``12/32 layers (selective 4, full 8)``."""
    sel, full = plan.count("selective"), plan.count("full")
    return f"{sel + full}/{len(plan)} layers (selective {sel}, full {full})"


def describe(plan: Sequence[str]) -> str:
    """``full 0-31, selective 32-79`` (layers by mode, in order); ``no layer`` when nothing recomputes."""
    runs: list[list] = []  # [mode, first, last]
    for i, mode in enumerate(plan):
        if runs and runs[-1][0] == mode:
            runs[-1][2] = i
        else:
            runs.append([mode, i, i])
    text = ", ".join(f"{m} {a}" if a == b else f"{m} {a}-{b}" for m, a, b in runs if m != "none")
    return text or "no layer"
