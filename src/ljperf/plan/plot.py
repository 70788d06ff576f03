"""The memory picture: the forecast's memory over one rank's step as stacked areas by component (parameters,
gradients, optimizer states, activations, logits and loss, temporaries, buffers), block by block through forward,
backward and the optimizer step, with the budget, the device's capacity and a benchmark's measured peak as lines.

Run: ``ljperf plan --model fsdp/llama3-8b --gpus 8 --gpu H100 --plot mem.png`` or
``ljperf benchmark --model torch/llama-tiny --plot mem.png``; ``draw_memory(path, memory_over_step(...), ...)``.
matplotlib (Agg) is imported when a picture is drawn.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ljperf.core.plans import Plan, describe
from ljperf.core.records import write_atomic
from ljperf.core.units import format_bytes, unit_of
from ljperf.forecast.over_step import COMPONENTS, LABELS, StepMemory, memory_over_step
from ljperf.forecast.recipe import Recipe
from ljperf.plan.device import device_memory
from ljperf.run.config import RunConfig
from ljperf.run.context import RunContext
from ljperf.run.titles import run_title, shape_title

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLORS = dict(zip(COMPONENTS, ("#4c72b0", "#8172b2", "#c44e52", "#937860", "#da8bc3", "#64b5cd", "#55a868",
                               "#ccb974", "#dd8452", "#8c8c8c"), strict=True))  # fmt: skip
STAGE_SHADES = {"forward": "#e8f0fb", "backward": "#fbeee8", "optimizer step": "#eef7ea"}
FIGURE_INCHES = (11.0, 5.0)
"""The picture's size: about 1,300 pixels wide at 120 dpi, read at 100% on a laptop screen whatever the depth."""
MOST_TICKS = 14
"""Moments named on the axis at most."""
OFF_CHART = 3.0
"""A line more than this many times the highest point is named in the legend, not drawn (it would flatten the
areas: a CPU's RAM against a tiny model)."""


def memory_figure(
    memory: StepMemory, *, title: str, budget: int | None, capacity: int | None, measured: int | None = None
) -> Figure:
    """The picture of ``memory`` (``forecast.over_step``) titled ``title``, with the lines given (bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = memory.points
    names = [n for n in dict.fromkeys([*COMPONENTS, *points[0].bytes]) if any(p.bytes.get(n) for p in points)]
    highest = max(p.total for p in points)
    unit, scale = unit_of(max(highest, measured or 0))
    # Constrained layout keeps the legend inside the figure, so its pixel size is the same whatever the labels.
    fig, ax = plt.subplots(figsize=FIGURE_INCHES, layout="constrained")
    x = list(range(len(points)))
    series = [[p.bytes.get(n, 0) / scale for p in points] for n in names]
    ax.stackplot(x, series, labels=[LABELS.get(n, n) for n in names], colors=[COLORS[n] for n in names])
    _shade_stages(ax, memory)
    peak = memory.points[memory.peak]
    ax.plot([memory.peak], [peak.total / scale], "v", color="black", label=f"forecast peak {format_bytes(peak.total)}")
    top = max(highest, measured or 0, budget or 0)
    lines = (("measured peak", measured, "black", ":"), ("budget", budget, "tab:orange", "-."))
    for label, value, color, style in (*lines, ("device capacity", capacity, "tab:red", "--")):
        if value is None:
            continue
        if value > OFF_CHART * top:
            ax.plot([], [], " ", label=f"{label} {format_bytes(value)} (above the chart)")
        else:
            ax.axhline(value / scale, color=color, linestyle=style, label=f"{label} {format_bytes(value)}")
            top = max(top, value)
    ax.set_ylim(min(0.0, min(min(s) for s in series)), 1.12 * top / scale)
    ax.set_xlim(0, max(1, len(points) - 1))
    _ticks(ax, memory)
    ax.set_ylabel(f"memory per rank ({unit})")
    ax.set_xlabel("moments of the step, block by block (forecast walk)")
    ax.set_title(f"{title}\nforecast peak {format_bytes(peak.total)} at {peak.phase}", fontsize=10)
    fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _shade_stages(ax: Any, memory: StepMemory) -> None:
    """A band behind each run of forward, backward or optimizer-step moments, named at the top."""
    start = 0
    points = memory.points
    for i in range(1, len(points) + 1):
        if i < len(points) and _where(points[i].phase) == _where(points[start].phase):
            continue
        stage = points[start].stage
        ax.axvspan(start - 0.5, i - 0.5, color=STAGE_SHADES.get(stage, "#f4f4f4"), zorder=0)
        ax.text((start + i - 1) / 2, 0.99, _where(points[start].phase), transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize=7)  # fmt: skip
        start = i


def _where(phase: str) -> str:
    """``forward, micro-step 1`` of ``forward, micro-step 1, layer 0``: a stage of one micro-step."""
    return ", ".join(phase.split(", ")[:2]) if not phase.startswith("optimizer") else "optimizer step"


def _ticks(ax: Any, memory: StepMemory) -> None:
    """A few moments named by their block (``layer 3``, ``LM head and loss``): where each stage starts, the peak,
    the last, and evenly spaced ones between, never closer than ``1 / MOST_TICKS`` of the axis (a label per block
    was 100+ labels at 6 pt on 70B)."""
    points, n = memory.points, len(memory.points)
    stage_starts = [i for i in range(n) if i == 0 or _where(points[i].phase) != _where(points[i - 1].phase)]
    gap = max(1, n // MOST_TICKS)
    ticks: list[int] = []
    for i in sorted({*stage_starts, memory.peak, n - 1}, key=lambda i: (i != memory.peak, i)):
        if all(abs(i - t) >= gap for t in ticks):
            ticks.append(i)
    for i in range(0, n, gap):
        if len(ticks) < MOST_TICKS and all(abs(i - t) >= gap for t in ticks):
            ticks.append(i)
    ticks.sort()
    ax.set_xticks(ticks, [_block(points[i].phase) for i in ticks], rotation=30, ha="right", fontsize=8)


def _block(phase: str) -> str:
    """The block of a moment; a micro-step's own last moment (after its blocks' backward) is its end."""
    parts = phase.split(", ")
    if len(parts) == 2 and parts[1].startswith("micro-step"):
        return "end of micro-step"
    return ", ".join(parts[2:]) if len(parts) > 2 else parts[-1]


def draw_memory(path: str | Path, memory: StepMemory, **lines: Any) -> None:
    """Write ``memory_figure(memory, **lines)`` to ``path`` (atomically; the suffix says png, svg or pdf)."""
    import matplotlib.pyplot as plt

    fig = memory_figure(memory, **lines)
    kind = Path(path).suffix.lstrip(".").lower()
    try:
        write_atomic(path, lambda f: fig.savefig(f, dpi=120, format=kind))
    finally:
        plt.close(fig)


def recipe_title(recipe: Recipe, *, model: str) -> str:
    """``engine/model · world × device · mb × seq × accum · precision · recompute ...``."""
    zero = f" (ZeRO-{recipe.zero_stage})" if recipe.engine == "deepspeed" else ""
    where = f"{recipe.world} × {recipe.device}{zero}"
    return shape_title(recipe.engine, model, where=where, shape=asdict(recipe)) + f" · {_recompute(recipe.recompute)}"


def _recompute(plan: tuple[str, ...] | None) -> str:
    """``recompute full 0-3`` for a title, or ``no recompute``."""
    words = describe(plan) if plan else "no layer"
    return "no recompute" if words == "no layer" else f"recompute {words}"


def plan_picture(path: str, *, cfg: RunConfig, report: dict, device_name: str | None) -> None:
    """The picture of ``ljperf plan``'s ``report`` for ``cfg``: its recipe's forecast over the step (with the plan
    ``--recompute auto`` chose), the budget and the device's memory."""
    recipe = Recipe.of(
        cfg,
        world=report["recipe"]["world"],
        device=cfg.train.resolved_device,
        recompute=tuple(report["recipe"]["recompute"]),
    )
    memory = memory_over_step(cfg.model, recipe, device_name=device_name)
    title = recipe_title(recipe, model=cfg.model.name)
    draw_memory(path, memory, title=title, budget=report["memory_budget_bytes"], capacity=report["gpu_memory_bytes"])


def benchmark_picture(path: str, *, run: RunContext, record: dict, plan: Plan | None, budget: int | None) -> None:
    """The picture of a benchmark run: its recipe's forecast over the step, the measured peak and the budget of
    ``--recompute auto`` (``budget``) drawn on it, the device's capacity."""
    recipe = Recipe.from_run(run, recompute=tuple(plan or ()))
    memory = memory_over_step(run.model, recipe, device_name=run.device.calibration_name)
    capacity, _ = device_memory(gpu_memory=None, gpu=None, device=run.device.type)
    title = run_title(record["config"]) + f" · {_recompute(plan)}"
    measured = record["results"].get("peak_allocated_bytes")
    draw_memory(path, memory, title=title, budget=budget, capacity=capacity, measured=measured)
