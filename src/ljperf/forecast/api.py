"""``forecast(spec, recipe)``: traced patterns → composed timeline → device overheads (see ``__init__``)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, fields, replace

from ljperf.core.errors import UsageError
from ljperf.core.options import LARGEST, LOSS_CHUNKS
from ljperf.forecast import analytic, timeline
from ljperf.forecast.blocks import block_params, recipe_blocks
from ljperf.forecast.cache_key import FamilyKey
from ljperf.forecast.calibrate import overheads_for
from ljperf.forecast.patterns import Patterns, family
from ljperf.forecast.pipeline import pipeline_split
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.forecast.segments import Segment, SegmentKey, TraceError
from ljperf.forecast.sharding import engine_sharding
from ljperf.forecast.trace import family_key, is_cached, layer_picks, reference_kind, traced_patterns
from ljperf.forecast.walk import TOKEN_BYTES, optimizer_transient
from ljperf.models.spec import ModelSpec


def _patterns(spec: ModelSpec, recipe: Recipe, *, mode: str, pick: tuple[int, ...] | None) -> Patterns:
    """The traced patterns of ``recipe``'s code path in recompute ``mode`` (of a copy of layers ``pick``): of the
    first micro-step alone where ``recipe`` has one (the walk reads the second one's only for later micro-steps)."""
    traced, key = _family(spec, recipe, mode=mode, pick=pick)
    return traced_patterns(traced, key, device=recipe.device, first_only=recipe.grad_accum == 1)


def _family(spec: ModelSpec, recipe: Recipe, *, mode: str, pick: tuple[int, ...] | None) -> tuple[ModelSpec, FamilyKey]:
    return family_key(
        spec,
        precision=recipe.trace_precision,
        attn=recipe.attn_implementation,
        mode=mode,
        micro_batch=recipe.micro_batch,
        seq_len=recipe.seq_len,
        pick=pick,
        tp=recipe.tp,
        loss=recipe.loss,
    )


def _requests(spec: ModelSpec, recipe: Recipe) -> Iterator[tuple[str, tuple[int, ...] | None]]:
    """The (recompute mode, layer pick) of each family ``all_patterns`` reads for ``recipe``."""
    picks = layer_picks(block_params(spec).layer_kinds)
    for mode in dict.fromkeys(recipe.layer_modes(spec.layers)):
        yield from ((mode, pick) for pick in picks.values())


def trace_ahead(
    spec: ModelSpec,
    recipes: Iterable[Recipe],
    *,
    jobs: int,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> int:
    """Trace the shape families ``recipes`` read that the cache lacks, ``jobs`` processes at once (a cold search's
    most time): how many; ``progress(done, total)`` as each is done. A family that fails is traced again by the
    forecast that reads it, which says why."""
    todo: dict[FamilyKey, tuple[Recipe, str, tuple[int, ...] | None]] = {}
    seen: set[tuple] = set()
    for recipe in recipes:
        shape = (recipe.trace_precision, recipe.attn_implementation, family(recipe.micro_batch), recipe.seq_len)
        for mode, pick in _requests(spec, recipe):
            request = (*shape, recipe.device, recipe.tp, recipe.loss, recipe.grad_accum == 1, mode, pick)
            if request in seen:
                continue
            seen.add(request)
            _, key = _family(spec, recipe, mode=mode, pick=pick)
            if key not in todo and not is_cached(key, first_only=recipe.grad_accum == 1):
                todo[key] = (recipe, mode, pick)
    if jobs < 2 or len(todo) < 2:
        return 0
    spawn = multiprocessing.get_context("spawn")  # torch's thread pools do not survive a fork
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=spawn) as pool:
        futures = [pool.submit(_trace_one, (spec, *request)) for request in todo.values()]
        for done, _ in enumerate(as_completed(futures), 1):
            progress(done, len(futures))
    return len(todo)


def _trace_one(request: tuple[ModelSpec, Recipe, str, tuple[int, ...] | None]) -> None:
    spec, recipe, mode, pick = request
    with contextlib.suppress(TraceError):
        _patterns(spec, recipe, mode=mode, pick=pick)


def all_patterns(spec: ModelSpec, recipe: Recipe) -> dict[tuple[str, int], Patterns]:
    """The traced patterns of each recompute mode ``recipe`` uses and each kind of layer (raises ``TraceError``)."""
    picks = layer_picks(block_params(spec).layer_kinds)
    return {
        (mode, kind): _patterns(spec, recipe, mode=mode, pick=pick)
        for mode in dict.fromkeys(recipe.layer_modes(spec.layers))
        for kind, pick in picks.items()
    }


def forecast(spec: ModelSpec, recipe: Recipe, *, device_name: str | None = None) -> Forecast:
    """Peak memory of one rank running ``recipe``; overheads: calibrated for ``device_name``, else defaults. Under
    ``--pp`` the highest pipeline rank's, each stage walked in its schedule (``pipeline_forecast``)."""
    if recipe.pp > 1 and recipe.stage is None:
        return pipeline_forecast(spec, recipe, device_name=device_name)
    try:
        raw = timeline.compose(spec, recipe, all_patterns(spec, recipe))
    except TraceError as exc:
        raw = analytic_forecast(spec, recipe, reason=str(exc))
    terms = overheads_for(recipe.device, device_name)
    allocated, reserved = terms.apply(raw.peak_allocated_bytes)
    breakdown = dict(raw.breakdown)
    if allocated != raw.peak_allocated_bytes:
        breakdown["device_overhead"] = allocated - raw.peak_allocated_bytes
    notes = list(raw.notes)
    experts = spec.fact("num_local_experts") or spec.fact("num_experts")
    if experts and experts > 1 and raw.source == "analytic":
        notes.append(
            f"mixture of {experts} experts, not traced: the analytic formula counts the experts' activations as"
            " transformers' experts loop keeps them (mixtral-tiny, fp32, 2 x 128 on the CPU: -0.4%; traced: exact)"
        )
    if recipe.engine == "deepspeed" and recipe.zero.offload:
        notes.append(
            f"{' and '.join(recipe.zero.offload)} not modelled: the offloaded states are counted on the device"
            " (an upper bound)"
        )
    if recipe.device == "cuda" and not terms.samples:
        notes.append(uncalibrated_note(device_name))
    return replace(
        raw,
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        context_bytes=terms.context,
        breakdown=breakdown,
        traced_peak_bytes=raw.peak_allocated_bytes,
        notes=notes,
    )


def pipeline_forecast(spec: ModelSpec, recipe: Recipe, *, device_name: str | None) -> Forecast:
    """The forecast of each pipeline rank of ``recipe`` (its stage's layers, the micro-batches its schedule holds
    in flight, the hidden states it passes), the highest's returned with every rank's peak. A rank of
    ``interleaved-1f1b`` holds several stages: their peaks are added (an upper bound: they do not all peak at once)."""
    split = pipeline_split(spec, recipe)
    each = [
        stage_forecast(spec, recipe.with_(pp_split=split, stage=i), device_name=device_name)
        for i in range(recipe.stages)
    ]
    per_rank = [sum(f.peak_allocated_bytes for f in each[r :: recipe.pp]) for r in range(recipe.pp)]
    highest = max(range(recipe.pp), key=lambda r: per_rank[r])
    worst = each[highest]
    notes = list(worst.notes)
    if recipe.pp_stages_per_rank > 1:
        notes.append("interleaved-1f1b: a rank's stages' peaks are added, an upper bound of its peak")
    return replace(
        worst,
        peak_allocated_bytes=per_rank[highest],
        phase=f"pipeline rank {highest}, {worst.phase}",
        stage_peaks=tuple(per_rank),
        pp_split=split,
        notes=notes,
    )


_STAGES: dict[tuple, Forecast] = {}
_STAGE_FIELDS = tuple(f.name for f in fields(Recipe) if f.name != "recompute")
STAGES_KEPT = 100_000


def stage_forecast(spec: ModelSpec, stage: Recipe, *, device_name: str | None) -> Forecast:
    """The forecast of pipeline stage ``stage.stage``, memoized: a traced stage reads only its own layers'
    recompute modes (and which modes the plan traces), so the plans a solver tries that differ in other stages'
    layers find it done."""
    plan = stage.layer_modes(spec.layers)
    mine = plan[stage.stage_layers.start : stage.stage_layers.stop]
    key = (spec.digest, *(getattr(stage, name) for name in _STAGE_FIELDS), mine, frozenset(plan), device_name)
    if key not in _STAGES:
        result = forecast(spec, stage, device_name=device_name)
        if result.source != "traced":  # the analytic formula counts the whole model's plan
            return result
        if len(_STAGES) >= STAGES_KEPT:
            _STAGES.clear()
        _STAGES[key] = result
    return _STAGES[key]


def uncalibrated_note(device_name: str | None) -> str:
    """Why the CUDA overheads are defaults, and how to calibrate them: for a GPU the plan names (``--gpu``, or
    this machine's), its records; for an unnamed one (``--gpu-memory`` alone), naming it too."""
    if device_name is None:
        return (
            "CUDA overheads are uncalibrated defaults: run ljperf plan --calibrate on benchmark records, then plan"
            " on that GPU or name it with --gpu"
        )
    return (
        f"CUDA overheads are uncalibrated defaults: no calibration for {device_name} is saved here; run ljperf plan"
        " --calibrate on benchmark records made on that GPU, then plan again"
    )


def max_micro_batch(spec: ModelSpec, recipe: Recipe, memory: int, *, device_name: str | None) -> int:
    """The largest micro batch whose forecast fits ``memory`` (0 when even 1 does not)."""

    def fits(b: int) -> bool:
        return forecast(spec, recipe.with_(micro_batch=b), device_name=device_name).device_bytes <= memory

    if not fits(1):
        return 0
    lo, hi = 1, 2  # lo fits; hi does not, once the doubling stops
    while hi <= LARGEST and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, LARGEST + 1)  # the largest --micro-batch ljperf runs bounds the answer
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def analytic_forecast(spec: ModelSpec, recipe: Recipe, *, reason: str) -> Forecast:
    """The closed-form fallback: model states plus the end-of-forward activations, or the optimizer step (a
    pipeline stage's states; its activations as the whole model's, an upper bound)."""
    blocks = recipe_blocks(spec, recipe)
    shard = engine_sharding(spec, recipe)
    batch = recipe.grad_accum * recipe.micro_batch * recipe.seq_len * TOKEN_BYTES
    states = shard.params + shard.optimizer + shard.comm_buffers + blocks.buffer_bytes + batch
    # tensor parallel: each rank keeps about 1/tp (sequence parallel; the loss's logits split by vocabulary)
    acts = analytic.activation_bytes(spec, recipe) // recipe.tp
    logits_grad = recipe.micro_batch * recipe.seq_len * spec.vocab * 4 // recipe.tp
    if recipe.loss == "chunked":
        logits_grad //= LOSS_CHUNKS
    grads_seen = shard.grads if recipe.grad_accum > 1 else 0
    gathered = max(max(g.forward, g.backward) for g in map(shard.gathering.layer, range(blocks.layers)))
    forward = states + grads_seen + acts + logits_grad + shard.gathering.resident + gathered
    optimizer = (
        states + shard.grads + optimizer_transient(blocks, recipe, local_params=shard.params, flat=shard.optimizer_flat)
    )
    parts = {
        "parameters": shard.params + blocks.buffer_bytes,
        "optimizer_states": shard.optimizer,
        "gradients": grads_seen if forward >= optimizer else shard.grads,
        "activations": acts if forward >= optimizer else 0,
        "logits_and_loss": logits_grad if forward >= optimizer else 0,
        "gathered_parameters": shard.gathering.resident + gathered if forward >= optimizer else 0,
        "batch": batch,
        "comm_buffers": shard.comm_buffers,
    }
    peak = max(forward, optimizer)
    parts["temporaries"] = peak - sum(parts.values())
    return Forecast(
        peak_allocated_bytes=peak,
        peak_reserved_bytes=None,
        context_bytes=0,
        breakdown={k: v for k, v in parts.items() if v},
        phase="backward, micro-step 1, LM head and loss" if forward >= optimizer else "optimizer step",
        source="analytic",
        analytic_reason=reason,
        notes=[f"traced forecast unavailable ({reason}); analytic formula used"],
    )


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One middle decoder layer in one recompute mode, at the recipe's shape."""

    saved_bytes: int
    """Bytes it keeps from its forward until its backward."""


def layer_costs(spec: ModelSpec, recipe: Recipe, *, modes: tuple[str, ...] = ("none", "full")) -> dict[str, LayerCost]:
    """``{mode: LayerCost}`` for a solver: cheap once the patterns are cached."""
    out = {}
    kinds = block_params(spec).layer_kinds
    pick = layer_picks(kinds)[reference_kind(kinds)]  # the most frequent kind of layer stands for all
    for mode in modes:
        try:
            pats = _patterns(spec, recipe, mode=mode, pick=pick)
        except TraceError as exc:
            raise UsageError(f"cannot trace {spec.name}: {exc}") from None
        values = pats.evaluate(recipe.micro_batch, recipe.seq_len)
        out[mode] = LayerCost(saved_bytes=values[SegmentKey(Segment.F1, 1)][1])
    return out
