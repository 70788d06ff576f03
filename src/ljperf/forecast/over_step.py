"""The forecast's memory over one rank's step, moment by moment and component by component: the data of the
memory picture (``ljperf plan --plot``, ``ljperf benchmark --plot``).

Use: ``memory_over_step(spec, recipe, device_name=None)`` → ``StepMemory``: each moment the step walk visited
(``walk.walk_step``: forward, backward and optimizer step, block by block) with its bytes by component; the
moment at ``peak`` holds the forecast breakdown's bytes (``forecast(spec, recipe).breakdown``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ljperf.forecast import timeline
from ljperf.forecast.api import all_patterns, forecast
from ljperf.forecast.calibrate import overheads_for
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.forecast.walk import Moment
from ljperf.models.spec import ModelSpec

COMPONENTS = (
    "parameters",
    "optimizer_states",
    "gradients",
    "batch",
    "comm_buffers",
    "gathered_parameters",
    "activations",
    "logits_and_loss",
    "temporaries",
    "device_overhead",
)
"""What the forecast counts, those that live through the step first (the order of the picture's stack)."""
LABELS = {
    "parameters": "parameters (+ model buffers)",
    "optimizer_states": "optimizer states",
    "gradients": "gradients",
    "batch": "batch (token ids)",
    "comm_buffers": "communication buffers",
    "gathered_parameters": "gathered parameters",
    "activations": "activations (saved for backward)",
    "logits_and_loss": "logits and loss",
    "temporaries": "temporaries",
    "device_overhead": "device overhead (workspaces, allocator)",
}
"""Each component's name for people, the same in the plan's table and its picture."""
STAGES = ("forward", "backward", "optimizer step")


@dataclass(frozen=True)
class Point:
    """One moment of the step: where (``phase``: ``forward, micro-step 1, layer 0``) and its bytes by component."""

    phase: str
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def stage(self) -> str:
        """forward, backward or optimizer step."""
        return self.phase.split(",")[0]


@dataclass(frozen=True)
class StepMemory:
    """The forecast of a recipe and its memory over the step."""

    forecast: Forecast
    points: tuple[Point, ...]
    peak: int
    """The index of the point at the forecast's peak."""


def memory_over_step(spec: ModelSpec, recipe: Recipe, *, device_name: str | None = None) -> StepMemory:
    """The memory of ``recipe``'s highest rank at each moment of its step, with the device overheads of
    ``device_name`` (as ``forecast`` adds them); the analytic fallback knows its peak alone, one point."""
    result = forecast(spec, recipe, device_name=device_name)
    if result.source != "traced":
        return StepMemory(forecast=result, points=(Point(phase=result.phase, bytes=dict(result.breakdown)),), peak=0)
    walk = timeline.highest_walk(spec, recipe, all_patterns(spec, recipe), record=True)  # traced: cached now
    assert walk.history is not None  # recorded
    terms = overheads_for(recipe.device, device_name)
    points = tuple(_point(moment, overhead=terms.apply(moment.total)[0] - moment.total) for moment in walk.history)
    peak = next(i for i, m in enumerate(walk.history) if m.total == walk.peak and m.phase == walk.phase)
    return StepMemory(forecast=result, points=points, peak=peak)


def _point(moment: Moment, *, overhead: int) -> Point:
    parts = {**moment.parts, "temporaries": moment.total - sum(moment.parts.values()), "device_overhead": overhead}
    return Point(phase=moment.phase, bytes={name: parts.get(name, 0) for name in COMPONENTS} | parts)
