"""``ljperf plan --search``: every recipe of the axes (``plan.search_space``) that fits, ranked by predicted speed.

Run: ``search(Setting(spec=spec, base=recipe, axes=axes, budget=budget, ...))`` → ``Outcome`` (every recipe
forecast, the ranking, the counts pruned). Cheap bounds first: a layout whose parameters, gradients and AdamW
states alone exceed the budget is not traced, and within one configuration a micro batch that does not fit ends
the larger ones (its activations only grow). Under a held global batch each recipe is priced first (``auto``
without recompute) and one that cannot beat the table's last so far is not forecast (``walk_groups``). Every
other recipe is forecast exactly (``forecast.api.forecast``,
traced once per shape family and cached) and, if it fits the budget, priced by the step-time model
(``speed.api.speed_for``). ``auto`` recompute is solved (``recompute.solver``) only where no recompute does not fit
and full recompute does: elsewhere it is no recompute, or nothing; a plan of one mode for every layer is that mode's
recipe where the axes have it.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TypeVar, get_args

from ljperf.core.choices import Loss, OptimizerImpl
from ljperf.core.errors import UsageError
from ljperf.core.plans import RecomputeMode
from ljperf.core.units import format_bytes
from ljperf.forecast.api import forecast, trace_ahead
from ljperf.forecast.calibrate import overheads_for
from ljperf.forecast.pipeline import pipeline_split
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.forecast.sharding import engine_sharding
from ljperf.models.spec import ModelSpec
from ljperf.plan.search_space import Axes, Candidate, Layout, batch_splits, layouts
from ljperf.recompute.solver import solve_for_plan
from ljperf.run.config import check_chunked_loss
from ljperf.speed.api import speed_for
from ljperf.speed.rates import Cluster
from ljperf.speed.step_time import Speed

PRUNED = {
    "states": "parameters, gradients and AdamW states alone over the budget",
    "micro_batch": "a smaller micro batch of the same recipe did not fit",
    "auto_is_fixed": "recompute auto is a choice of its own (no recompute that fits, or every layer one mode)",
    "cannot_win": "slower than the table's last recipe (recompute auto: even without recompute)",
}
"""Why a candidate was not forecast, by the key ``Outcome.pruned`` counts it under."""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What a search is for: the model, the flags' recipe, the axes and the memory it must fit."""

    spec: ModelSpec
    base: Recipe
    """The flags' recipe: world, device, precision, sequence length, attention, ZeRO settings."""
    axes: Axes
    budget: int
    """Bytes per device a ranked recipe's forecast must fit (``recompute.budget.budget_bytes``)."""
    memory: int
    """The device's bytes (``--gpu-memory``, ``--gpu``): what ``auto`` solves its budget from."""
    memory_budget: str | None
    """``--memory-budget`` as given (``auto``'s budget where set)."""
    device_name: str | None
    cluster: Cluster
    threads: int | None
    per_node: int
    """Ranks per node: tensor parallel stays within one."""
    top: int = 5
    """Recipes the table shows: ``auto`` is solved only where it could be one of them."""
    jobs: int = 1
    """Processes that trace the shape families the cache lacks at once, before the search forecasts
    (``forecast.api.trace_ahead``)."""


@dataclass(frozen=True, kw_only=True)
class Evaluated:
    """A candidate forecast exactly, and its predicted speed where it fits."""

    candidate: Candidate
    recipe: Recipe
    forecast: Forecast
    fits: bool
    speed: Speed | None


@dataclass(kw_only=True)
class Outcome:
    """Every candidate forecast, in the order evaluated, and the counts pruned (``PRUNED``'s keys)."""

    evaluated: list[Evaluated] = field(default_factory=list)
    pruned: Counter[str] = field(default_factory=Counter)
    smallest_bound: tuple[int, Candidate] | None = None
    """The lowest states bound of a layout pruned by it, and a candidate of that layout: what nothing-fits says
    when no candidate was forecast at all."""

    def floor(self, top: int) -> float | None:
        """The tokens/s per device of the table's ``top``-th recipe so far, ties of one above left out (None:
        fewer fit): a recipe predicting less cannot enter the table, nor change the ranks it shows."""
        shown = distinct(self.ranked(), top, speed=lambda e: e.speed.tokens_per_s_per_device if e.speed else 0.0,
                         peak=lambda e: e.forecast.device_bytes)  # fmt: skip
        return shown[-1].speed.tokens_per_s_per_device if len(shown) == top and shown[-1].speed else None

    def ranked(self) -> list[Evaluated]:
        """The candidates that fit, fastest first (ties: the smaller peak first)."""
        fitting = [(e.speed.tokens_per_s_per_device, e) for e in self.evaluated if e.fits and e.speed is not None]
        return [e for _, e in sorted(fitting, key=lambda f: (-f[0], f[1].forecast.device_bytes))]


T = TypeVar("T")


def distinct(ranked: list[T], top: int, *, speed: Callable[[T], float], peak: Callable[[T], int]) -> list[T]:
    """The first ``top`` of ``ranked`` that are not ties of one before them: the same peak and predicted speed to
    0.1% (AdamW kinds the model prices alike)."""
    shown: list[T] = []
    for r in ranked:
        if len(shown) == top:
            break
        rate = speed(r)
        if not any(peak(s) == peak(r) and abs(speed(s) - rate) <= 1e-3 * rate for s in shown):
            shown.append(r)
    return shown


@dataclass(frozen=True, kw_only=True)
class Configuration:
    """A candidate but for its batch split: a layout, a loss, an AdamW kind, a recompute choice."""

    layout: Layout
    loss: Loss
    optimizer: OptimizerImpl | None
    recompute: str
    splits: tuple[tuple[int, int], ...]

    def candidate(self, micro_batch: int, grad_accum: int) -> Candidate:
        return Candidate(
            layout=self.layout,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            recompute=self.recompute,
            loss=self.loss,
            optimizer=self.optimizer,
        )


def configurations(setting: Setting) -> list[Configuration]:
    """Every configuration of the axes whose layout can make the global batch (exit 2 when none can)."""
    axes, base, spec = setting.axes, setting.base, setting.spec
    out, sizes = [], set()
    for layout in layouts(axes, spec=spec, world=base.world, seq_len=base.seq_len, per_node=setting.per_node):
        splits = batch_splits(axes, dp=layout.dp(base.world))
        sizes.add(layout.dp(base.world))
        if splits and layout.pp > 1:  # 1F1B keeps --pp micro-batches in flight: a step needs as many
            if axes.global_batch is None and axes.grad_accum is None:  # --pp's default: one a stage
                splits = [(b, layout.pp) for b, _ in splits]
            splits = [(b, a) for b, a in splits if a >= layout.pp]
        if not splits:
            continue
        for loss in losses(axes, spec, layout):
            for optimizer in (None,) if layout.engine == "deepspeed" else axes.optimizers:
                for recompute in axes.recompute:
                    out.append(Configuration(layout=layout, loss=loss, optimizer=optimizer, recompute=recompute,
                                             splits=tuple(splits)))  # fmt: skip
    if not out:
        raise UsageError(impossible_batch(axes, sorted(sizes)))
    return out


def impossible_batch(axes: Axes, sizes: list[int]) -> str:
    """Why no layout takes the batch: the global batch against each data-parallel size, with the fixed split."""
    fixed = [f"--{k} {v}" for k, v in (("micro-batch", axes.micro_batch), ("grad-accum", axes.grad_accum)) if v]
    with_ = f" with {' and '.join(fixed)}" if fixed else ""
    ranks = ", ".join(map(str, sizes)) or "none"
    if axes.global_batch is None:
        return f"--search: no recipe on these axes{with_} (data-parallel ranks: {ranks})"
    return (
        f"--global-batch {axes.global_batch}: no micro batch × accumulation × data-parallel ranks makes it{with_}"
        f" (data-parallel ranks of the layouts searched: {ranks}); give a multiple of one of them"
    )


def losses(axes: Axes, spec: ModelSpec, layout: Layout) -> list[Loss]:
    """The losses a layout can run: the chunked one runs the LM head whole (not with tensor parallel; a pipeline's
    last stage runs it), on models whose forward it reproduces."""
    out: list[Loss] = []
    for loss in axes.losses:
        if loss == "chunked":
            try:
                check_chunked_loss(spec, loss=loss)
            except UsageError:
                continue
            if layout.tp > 1:
                continue
        out.append(loss)
    return out


def states_bound(setting: Setting, recipe: Recipe) -> int:
    """A lower bound of ``recipe``'s device bytes: its parameters, gradients and AdamW states, all alive at the
    optimizer step, with the device's overheads (no trace: the engine's sharding is arithmetic)."""
    terms = overheads_for(recipe.device, setting.device_name)
    stages = [recipe]
    if recipe.pp > 1:  # each pipeline rank holds its stage's states: the largest bounds the plan's peak
        split = pipeline_split(setting.spec, recipe)
        stages = [recipe.with_(pp_split=split, stage=i) for i in range(recipe.stages)]
    held = []
    for stage in stages:
        shard = engine_sharding(setting.spec, stage)
        held.append(shard.params + shard.grads + shard.optimizer)
    allocated, reserved = terms.apply(max(held))
    return (reserved or allocated) + terms.context


def search(setting: Setting, *, progress: Callable[[int, int], None] = lambda done, total: None) -> Outcome:
    """Every configuration's candidates, pruned by the bounds and forecast; ``progress(done, total)`` after each
    configuration priced, then after each candidate decided (the progress bar)."""
    outcome = Outcome()
    memo: dict[Recipe, Forecast] = {}

    def forecast_of(recipe: Recipe) -> Forecast:
        if recipe not in memo:
            memo[recipe] = forecast(setting.spec, recipe, device_name=setting.device_name)
        return memo[recipe]

    groups: list[Group] = []
    configs = configurations(setting)
    for done, config in enumerate(configs, 1):
        first = replace(config.candidate(*config.splits[0]), recompute="none")  # the states do not depend on it
        bound = states_bound(setting, first.recipe(setting.base, setting.spec))
        if bound > setting.budget:
            outcome.pruned["states"] += len(config.splits)
            if outcome.smallest_bound is None or bound < outcome.smallest_bound[0]:
                outcome.smallest_bound = (bound, first)
        else:
            held = setting.axes.global_batch is not None
            groups += [Group(config=config, splits=run, bounds=speed_bounds(setting, config, run, held=held))
                       for run in split_groups(config.splits, held=held)]  # fmt: skip
        progress(done, len(configs))
    trace_ahead(setting.spec, group_recipes(setting, groups), jobs=setting.jobs, progress=progress)
    walk_groups(setting, groups, outcome, forecast_of, progress=progress)
    return outcome


def group_recipes(setting: Setting, groups: list[Group]) -> Iterator[Recipe]:
    """Every recipe the groups' splits could forecast (``auto``: in each of the modes it solves among)."""
    for group in groups:
        for micro_batch, accum in group.splits:
            candidate = group.config.candidate(micro_batch, accum)
            modes = get_args(RecomputeMode) if candidate.recompute == "auto" else (candidate.recompute,)
            for mode in modes:
                yield replace(candidate, recompute=mode).recipe(setting.base, setting.spec)


def split_groups(splits: tuple[tuple[int, int], ...], *, held: bool) -> Iterator[list[tuple[int, int]]]:
    """Batch splits in runs where memory grows with the micro batch: under a held global batch, accumulation
    over one micro-step (no gradients alive through a later forward) apart from the rest."""
    if not held:
        yield list(splits)
        return
    yield from (run for run in ([s for s in splits if s[1] > 1], [s for s in splits if s[1] == 1]) if run)


@dataclass(kw_only=True)
class Group:
    """A configuration's batch splits in a run whose memory grows with the micro batch, smallest first, with an
    upper bound of each one's tokens/s per device; ``next``: the first not yet decided."""

    config: Configuration
    splits: list[tuple[int, int]]
    bounds: list[float]
    next: int = 0

    def best(self) -> float:
        """The bound of the splits left: the most any of them can predict."""
        return max(self.bounds[self.next :])


def speed_bounds(setting: Setting, config: Configuration, splits: list[tuple[int, int]], *, held: bool) -> list[float]:
    """Each split's predicted tokens/s per device, ``auto``'s without recompute (no plan is faster); without a
    held global batch none (infinity: the micro batches go on until one does not fit, each forecast)."""
    if not held:
        return [math.inf] * len(splits)
    out = []
    for micro_batch, accum in splits:
        candidate = config.candidate(micro_batch, accum)
        if config.recompute == "auto":
            candidate = replace(candidate, recompute="none")
        speed = speed_of(setting, candidate.recipe(setting.base, setting.spec))
        out.append(math.inf if speed is None else speed.tokens_per_s_per_device)
    return out


def speed_of(setting: Setting, recipe: Recipe) -> Speed | None:
    return speed_for(
        setting.spec, recipe, device_name=setting.device_name, cluster=setting.cluster, threads=setting.threads
    )


def walk_groups(
    setting: Setting,
    groups: list[Group],
    outcome: Outcome,
    forecast_of: Callable[[Recipe], Forecast],
    *,
    progress: Callable[[int, int], None],
) -> None:
    """Branch and bound on speed: the group whose splits left could predict the most goes on from its smallest
    split left; a split whose bound is below the table's last recipe so far (``Outcome.floor``) is not forecast,
    and once no group's can beat it the search ends. Memory only grows with the micro batch, so the first split
    of a group that does not fit ends the group. What it ranks in the table is what forecasting every split would
    rank: every recipe left out predicts less than the table's last."""
    total, done = sum(len(g.splits) for g in groups), 0
    heap = [(-g.best(), i) for i, g in enumerate(groups)]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        group, floor = groups[i], outcome.floor(setting.top)
        left = len(group.splits) - group.next
        if floor is not None and group.best() < floor:
            outcome.pruned["cannot_win"] += left
            group.next = len(group.splits)
        elif group.bounds[group.next] < (floor or -math.inf):
            outcome.pruned["cannot_win"] += 1
            group.next += 1
        elif evaluate_one(setting, group, outcome, forecast_of, floor=floor):
            group.next += 1
        else:
            if setting.axes.global_batch is not None:  # without one the micro batches go on for ever
                outcome.pruned["micro_batch"] += left - 1
            group.next = len(group.splits)
        done += left - (len(group.splits) - group.next)
        if group.next < len(group.splits):
            heapq.heappush(heap, (-group.best(), i))
        progress(done, total)


def evaluate_one(
    setting: Setting,
    group: Group,
    outcome: Outcome,
    forecast_of: Callable[[Recipe], Forecast],
    *,
    floor: float | None,
) -> bool:
    """Forecast ``group``'s next split (``auto``: solved first) and price it where it fits; False where it does
    not fit (which ends the group)."""
    candidate = group.config.candidate(*group.splits[group.next])
    if group.config.recompute == "auto":
        solved = solve_auto(setting, candidate, forecast_of, floor=floor)
        if isinstance(solved, str):
            outcome.pruned[solved] += 1
            return True
        candidate = solved
    recipe = candidate.recipe(setting.base, setting.spec)
    result = forecast_of(recipe)
    fits = result.device_bytes <= setting.budget
    speed = speed_of(setting, recipe) if fits else None
    outcome.evaluated.append(Evaluated(candidate=candidate, recipe=recipe, forecast=result, fits=fits, speed=speed))
    return fits


def solve_auto(
    setting: Setting, candidate: Candidate, forecast_of: Callable[[Recipe], Forecast], *, floor: float | None
) -> Candidate | str:
    """``candidate`` with ``auto`` solved to a per-layer plan, or the ``PRUNED`` key of why it is not a recipe of
    its own: no recompute fits, or the plan is one mode the axes have; or it cannot beat ``floor`` tokens/s per
    device (the table's last so far) even without recompute. Where full recompute does not fit either, auto is
    full recompute (which does not fit)."""
    spec, base = setting.spec, setting.base
    none = replace(candidate, recompute="none").recipe(base, spec)
    if forecast_of(none).device_bytes <= setting.budget:
        return "auto_is_fixed"
    full = none.with_(recompute=("full",) * spec.layers)
    if forecast_of(full).device_bytes > setting.budget:
        return replace(candidate, plan=full.recompute)
    if floor is not None:
        cluster, threads = setting.cluster, setting.threads
        fastest = speed_for(spec, none, device_name=setting.device_name, cluster=cluster, threads=threads)
        if fastest is not None and fastest.tokens_per_s_per_device <= floor:
            return "cannot_win"
    decision, _ = solve_for_plan(
        spec, none, memory=setting.memory, device_name=setting.device_name, given=setting.memory_budget
    )
    if len(set(decision.plan)) == 1 and decision.plan[0] in setting.axes.recompute:
        return "auto_is_fixed"
    return replace(candidate, plan=decision.plan)


def nothing_fits(setting: Setting, outcome: Outcome) -> str:
    """The line of a search where nothing fits: the least memory a candidate needs, and that candidate."""
    budget = format_bytes(setting.budget)
    forecasts = [(e.forecast.device_bytes, e.candidate) for e in outcome.evaluated]
    if forecasts:
        need, closest = min(forecasts, key=lambda f: f[0])
        what = "needs"
    elif outcome.smallest_bound is not None:
        need, closest = outcome.smallest_bound
        what = "needs at least"
    else:
        return f"--search: nothing to forecast within the budget {budget}"
    world = setting.base.world
    return (
        f"--search: nothing fits the budget {budget} a device: the closest recipe, {describe(closest, world)},"
        f" {what} {format_bytes(need)} ({format_bytes(need - setting.budget)} over); more GPUs, a larger"
        " --memory-budget or a shorter --seq-len"
    )


def describe(candidate: Candidate, world: int) -> str:
    """The candidate in words: ``ZeRO-3, micro batch 1 × 4, recompute full, chunked loss``."""
    layout, batch, recompute, loss, optimizer = choices(candidate, world)
    parts = [layout, batch, recompute]
    parts += [loss] if candidate.loss != "plain" else []
    parts += [optimizer] if candidate.optimizer is not None else []
    return ", ".join(parts)


def choices(candidate: Candidate, world: int) -> tuple[str, str, str, str, str]:
    """The candidate's choice on each axis in words: layout, batch split, recompute, loss, AdamW."""
    recompute = candidate.recompute if not candidate.plan else f"auto ({summarize(candidate.plan)})"
    return (
        candidate.layout.describe(world),
        f"micro batch {candidate.micro_batch} × {candidate.grad_accum}",
        f"recompute {recompute}",
        f"{candidate.loss} loss",
        f"{candidate.optimizer or 'engine'} AdamW",
    )


def summarize(plan: tuple[str, ...]) -> str:
    """``full 3, selective 2`` of a per-layer plan."""
    counts = Counter(plan)
    text = ", ".join(f"{mode} {counts[mode]}" for mode in ("full", "selective") if counts[mode])
    return text or "none"
