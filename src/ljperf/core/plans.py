"""Recompute plans as values: ``--recompute`` parsed, and one mode per decoder layer (none / selective / full).

Run: ``parse_recompute("2")`` → 2; ``fixed_plan(2, 4)`` → ``("full", "full", "none", "none")``. The engines apply a
plan (``ljperf.checkpoint``), the solver picks one (``ljperf.recompute``); neither is needed to read or print one.
"""

from collections.abc import Sequence
from typing import Any, Literal, TypeGuard, get_args

from ljperf.core.errors import UsageError
from ljperf.core.units import format_bytes

RecomputeMode = Literal["none", "selective", "full"]
"""Per-layer activation recomputation: keep everything, op-level SAC, or keep only the layer input."""

MODES: tuple[RecomputeMode, ...] = get_args(RecomputeMode)

Plan = tuple[RecomputeMode, ...]
"""One mode per layer, in layer order."""

Recompute = RecomputeMode | Literal["auto"] | int | Plan
"""``--recompute`` parsed: one mode for every layer, ``auto``, K (the first K layers full) or a plan."""

BUDGET_ENV = "LJPERF_MEMORY_BUDGET"
"""The memory budget of ``--recompute auto`` where ``--memory-budget`` is not given."""


def is_mode(value: object) -> TypeGuard[RecomputeMode]:
    """Whether ``value`` is one of ``MODES`` (for the type checker, a ``RecomputeMode`` from here on)."""
    return value in MODES


def parse_recompute(value: str) -> Recompute:
    """``--recompute``: ``none``, ``selective``, ``full`` (every layer), ``auto``, K (the first K layers full)
    or one mode per layer (``full,selective,none,...``)."""
    if is_mode(value) or value == "auto":
        return value
    if "," in value:
        modes = [m.strip() for m in value.split(",")]
        bad = [m for m in modes if not is_mode(m)]
        if bad:
            raise UsageError(f"--recompute {value!r}: {bad[0]!r} is not one of {', '.join(MODES)}")
        return tuple(m for m in modes if is_mode(m))
    try:
        k = int(value)
    except ValueError:
        raise UsageError(
            f"--recompute {value!r}: choose none, selective, full, auto, a layer count K or MODE,MODE,..."
        ) from None
    if k < 0:
        raise UsageError(f"--recompute {k}: K must be zero or more")
    return k


def fixed_plan(value: Recompute, layers: int) -> Plan:
    """The plan of ``--recompute none|selective|full|K|MODE,...`` (parsed) for a model of ``layers`` layers."""
    if is_mode(value):
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


def no_recompute_line(decision: dict[str, Any]) -> str | None:
    """One line for a ``--recompute auto`` decision (``recompute.solver.Decision.record()``) whose plan
    recomputes no layer because its budget holds the whole run, so the optimization silently does nothing; None
    for any other decision (a fixed plan has no budget)."""
    budget, peak = decision.get("budget_bytes"), decision.get("forecast_peak_bytes")
    if budget is None or peak is None or not decision.get("fits") or set(decision.get("plan") or ()) != {"none"}:
        return None
    none, full = decision.get("forecast_none_bytes"), decision.get("forecast_full_bytes")
    return f"recompute auto chose no recompute: {budget_holds_all(budget=budget, peak=peak, none=none, full=full)}"


def budget_holds_all(*, budget: int, peak: int, none: int | None, full: int | None) -> str:
    """``the budget X holds the whole run (forecast Y); set --memory-budget or $LJPERF_MEMORY_BUDGET to test it``,
    and with the forecasts with no and with full recompute, a budget between them (their midpoint) under which
    auto recomputes some layers, or that full recompute would save under 2%."""
    line = (
        f"the budget {format_bytes(budget)} holds the whole run (forecast {format_bytes(peak)}); set --memory-budget"
        f" or {BUDGET_ENV} to test it"
    )
    if none is None or full is None:
        return line
    if full >= 0.98 * none:
        return f"{line} (full recompute would save under 2%: forecast {format_bytes(full)} vs {format_bytes(none)})"
    middle = (none + full) // 2
    size = f"{round(middle / 2**20)}MiB"
    if not full < round(middle / 2**20) * 2**20 < none:  # MiB too coarse for the gap
        size = f"{middle // 1024}KiB"
    return (
        f"{line}, e.g. --memory-budget {size} (between the forecasts with full recompute, {format_bytes(full)}, and"
        f" none, {format_bytes(none)})"
    )
