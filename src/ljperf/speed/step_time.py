"""The step-time model's API: the work of a recipe's step (traced once per shape), and its seconds on a device's
rates (arithmetic alone: a search prices thousands of recipes a second once their shapes are traced).

Run: ``predict(step_work(spec, recipe, rates), rates)`` → ``Speed`` (step time, tokens/s per device, MFU and the
breakdown); ``speed.api.speed_for`` does both with the device's calibrated rates.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ljperf.forecast.blocks import block_params
from ljperf.forecast.pipeline import pipeline_split
from ljperf.forecast.recipe import Recipe
from ljperf.models.spec import ModelSpec
from ljperf.speed.census import OP_CLASSES, SAVED, Entry, StepOps, step_ops
from ljperf.speed.collectives import KINDS, Collective
from ljperf.speed.overlap import StepTimes, exposed, totals
from ljperf.speed.pipeline import LayerSeconds, PipelineWork, pipelined
from ljperf.speed.rates import SpeedRates, cpu_rates, gpu_rates
from ljperf.speed.traffic import EngineWork, Traffic, step_traffic

BREAKDOWN = ("forward", "backward", "recompute", "optimizer", *KINDS, "exposed_comm", "bubble")
"""The record's ``speed.breakdown``: compute by phase, each collective kind's seconds (hidden or not), the
communication left exposed, and the pipeline bubble (``--pp``: ``speed.pipeline``)."""


@dataclass(frozen=True, kw_only=True)
class Work:
    """Ops of one block priced at a device's peaks: roofline seconds per op class, and the op count."""

    roofline_s: dict[str, float]
    """Per op class, the sum over its ops of max(FLOPs / peak FLOP/s, bytes / peak bytes/s)."""
    ops: float

    def seconds(self, rates: SpeedRates) -> float:
        eff = rates.efficiency
        return sum(t / eff[c] for c, t in self.roofline_s.items()) + self.ops * rates.op_overhead_s

    def scaled(self, factor: float, *, ops: float = 1.0) -> Work:
        return Work(roofline_s={c: t * factor for c, t in self.roofline_s.items()}, ops=self.ops * ops)


def price(entries: tuple[Entry, ...], *, flops_per_s: float, bytes_per_s: float) -> Work:
    """``entries`` (``census.Entry``) as a ``Work`` at the given peaks."""
    roofline = dict.fromkeys(OP_CLASSES, 0.0)
    ops = 0
    for cls, flops, moved, calls in entries:
        roofline[cls] += calls * max(flops / flops_per_s, moved / bytes_per_s)
        ops += calls
    return Work(roofline_s=roofline, ops=float(ops))


@dataclass(frozen=True, kw_only=True)
class StepWork:
    """What one rank's step does: compute per block (one micro-step's), the optimizer step, the collectives."""

    layer_forward: Work
    layer_backward: Work
    recompute: dict[str, Work]
    """One layer's recompute in each mode (full: its forward again; selective: its ops other than ``SAVED``)."""
    rest_forward: Work
    rest_backward: Work
    optimizer: Work
    modes: tuple[str, ...]
    """Each decoder layer's recompute mode."""
    micro_steps: int
    traffic: Traffic
    tokens: int
    """Tokens this rank's step trains (a tensor-parallel group's shared tokens count once per group)."""
    model_flops: float
    """The step's model FLOPs on this rank (PaLM's definition, as the benchmark's MFU)."""
    pipeline: PipelineWork | None = None
    """``--pp``: the layers of each pipeline rank and a boundary's send (the rest is the whole model's)."""

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _optimizer(ops: StepOps, spec: ModelSpec, recipe: Recipe, *, bytes_per_s: float) -> Work:
    """The AdamW step over this rank's parameters: FSDP2's shards keep every tensor, ZeRO steps flat partitions."""
    blocks = block_params(spec, tp=recipe.tp)
    if recipe.engine == "fsdp":
        elements, tensors = blocks.total / recipe.mesh.dp_shard, blocks.tensors
    elif recipe.engine == "deepspeed":
        elements = blocks.total / recipe.world
        tensors = max(1, -(-int(elements) // recipe.zero.sub_group_size)) if recipe.zero_stage == 3 else 1
    else:
        elements, tensors = blocks.total, blocks.tensors
    moved = elements * recipe.weight_bytes * ops.optimizer_bytes_per_param_byte
    return Work(
        roofline_s={"optimizer": moved / bytes_per_s},
        ops=ops.optimizer_ops_fixed + tensors * ops.optimizer_ops_per_tensor,
    )


def step_work(spec: ModelSpec, recipe: Recipe, rates: SpeedRates) -> StepWork:
    """The work of ``recipe``'s step on one rank, priced at ``rates``' peaks (the census traced or cached)."""
    ops = step_ops(
        spec,
        micro_batch=recipe.micro_batch,
        seq_len=recipe.seq_len,
        precision=recipe.trace_precision,
        attn=recipe.attn_implementation,
        loss=recipe.loss,
        optimizer=recipe.optimizer_impl,
    )
    peaks = {"flops_per_s": rates.flops_per_s, "bytes_per_s": rates.bytes_per_s}
    share = 1 / recipe.tp  # tensor parallel splits each block's work (traced whole)

    def priced(entries: tuple[Entry, ...]) -> Work:
        return price(entries, **peaks).scaled(share)

    full = priced(ops.layer_forward)
    selective = priced(tuple(e for e in ops.layer_forward if e[0] not in SAVED))
    tokens = recipe.micro_batch * recipe.seq_len * recipe.grad_accum
    ranks = recipe.tp * recipe.pp  # the ranks that share a micro-batch's tokens
    return StepWork(
        layer_forward=full,
        layer_backward=priced(ops.layer_backward),
        recompute={"full": full, "selective": selective},
        rest_forward=priced(ops.rest_forward),
        rest_backward=priced(ops.rest_backward),
        optimizer=_optimizer(ops, spec, recipe, bytes_per_s=rates.bytes_per_s),  # memory-bound
        modes=recipe.layer_modes(spec.layers),
        micro_steps=recipe.grad_accum,
        traffic=step_traffic(spec, recipe),
        tokens=tokens // ranks,
        model_flops=spec.flops_per_token(recipe.seq_len) * tokens / ranks,
        pipeline=pipeline_work(spec, recipe) if recipe.pp > 1 else None,
    )


def pipeline_work(spec: ModelSpec, recipe: Recipe) -> PipelineWork:
    """``recipe``'s pipeline: the split the fsdp engine runs, and one micro-batch's hidden states a boundary."""
    split, act_bytes = pipeline_split(spec, recipe), 2 if recipe.precision != "fp32" else 4
    hidden = recipe.micro_batch * recipe.seq_len * spec.hidden * act_bytes / recipe.tp
    stride = recipe.world // recipe.pp  # pipeline ranks are the mesh's outermost dimension
    return PipelineWork(
        layers_per_rank=tuple(sum(split[r :: recipe.pp]) for r in range(recipe.pp)),
        stages_per_rank=recipe.pp_stages_per_rank,
        microbatches=recipe.grad_accum,
        send=Collective(kind="broadcast", what="pp_send", size_bytes=hidden, ranks=2, stride=stride),
    )


@dataclass(frozen=True, kw_only=True)
class Speed:
    """A step's predicted time on one rank and where it goes."""

    step_time_s: float
    tokens_per_s_per_device: float
    mfu: float | None
    """Model FLOPs per second over the device's peak (None where the peak is not a bf16 datasheet's)."""
    breakdown: dict[str, float]
    """Seconds per ``BREAKDOWN`` entry; the compute, exposed_comm and bubble add up to the step."""
    phases: dict[str, float]
    """Seconds by the benchmark's phase timers' phases (forward, backward, optimizer), exposed waits in them."""
    calibrated: bool
    rates: dict[str, Any]

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "phases"}


def predict(work: StepWork, rates: SpeedRates, *, peak_mfu: bool = True) -> Speed:
    """``work``'s seconds at ``rates``; ``peak_mfu``: its FLOP/s peak is a bf16 datasheet's, an MFU's base."""
    forward, backward = work.layer_forward.seconds(rates), work.layer_backward.seconds(rates)
    redo = {mode: w.seconds(rates) for mode, w in work.recompute.items()} | {"none": 0.0}
    per_layer = [redo[m] for m in work.modes]
    times = StepTimes(
        layer_forward=(forward,) * len(work.modes),
        layer_backward=tuple(backward + r for r in per_layer),
        rest_forward=work.rest_forward.seconds(rates),
        rest_backward=work.rest_backward.seconds(rates),
        micro_steps=work.micro_steps,
    )
    seconds = _pricer(rates)
    waits = exposed(work.traffic, seconds=seconds, times=times, overlap=rates.overlap)
    n, traffic = work.micro_steps, work.traffic
    engine = _engine_seconds(traffic, rates)
    reductions = n if traffic.bucketed_every_micro_step else 1
    parts = {
        "forward": n * (sum(times.layer_forward) + times.rest_forward + engine(traffic.engine_forward)),
        "backward": n * (backward * len(work.modes) + times.rest_backward + engine(traffic.engine_backward))
        + reductions * engine(traffic.engine_reduce),
        "recompute": n * sum(per_layer),
        "optimizer": work.optimizer.seconds(rates) + engine(traffic.engine_step),
    }
    parts |= dict.fromkeys(KINDS, 0.0) | totals(work.traffic, seconds=seconds, layers=len(work.modes), micro_steps=n)
    parts["exposed_comm"] = sum(waits.values())
    parts["bubble"] = 0.0
    if work.pipeline is not None:
        rest = times.rest_forward + times.rest_backward
        per = LayerSeconds(layer=(parts["forward"] + parts["backward"] + parts["recompute"] - n * rest) / n
                           / len(work.modes), rest=rest)  # fmt: skip
        parts = pipelined(parts, work.pipeline, per=per, seconds=seconds)
    step = sum(parts[k] for k in ("forward", "backward", "recompute", "optimizer", "exposed_comm", "bubble"))
    phases = {
        "forward": parts["forward"] + waits["forward"],
        "backward": parts["backward"] + parts["recompute"] + waits["backward"],
        "optimizer": parts["optimizer"] + waits["optimizer"],
    }
    return Speed(
        step_time_s=step,
        tokens_per_s_per_device=work.tokens / step,
        mfu=work.model_flops / step / rates.flops_per_s if peak_mfu else None,
        breakdown=parts,
        phases=phases,
        calibrated=rates.calibrated,
        rates=rates.record(),
    )


def _engine_seconds(traffic: Traffic, rates: SpeedRates) -> Callable[[EngineWork], float]:
    """The seconds of an engine's own work: its hooks at the engine's cost, its copies memory-bound."""
    hook = rates.hook_s.get(traffic.style, 0.0)
    copy = rates.bytes_per_s * rates.efficiency["elementwise"]
    return lambda w: w.hooks * hook + w.copy_bytes / copy


def _pricer(rates: SpeedRates) -> Callable[[Collective], float]:
    cache: dict[Collective, float] = {}

    def seconds(c: Collective) -> float:
        if c not in cache:
            cache[c] = c.seconds(rates.links)
        return cache[c]

    return seconds


def _load_collective(data: dict | None) -> Collective | None:
    return None if data is None else Collective(**data)


_COLLECTIVE_LISTS = ("layer_reduce", "root_reduce", "layer_tp_forward", "layer_tp_backward", "root_tp", "bucketed",
                     "after_step")  # fmt: skip


_ENGINE_WORK = ("engine_forward", "engine_backward", "engine_reduce", "engine_step")


def load_work(data: dict) -> StepWork:
    """A ``StepWork`` from its record (``StepWork.record``)."""

    def work(d: dict) -> Work:
        return Work(roofline_s={str(k): float(v) for k, v in d["roofline_s"].items()}, ops=float(d["ops"]))

    t = dict(data["traffic"])
    t |= {k: _load_collective(t[k]) for k in ("layer_gather", "root_gather")}
    t |= {k: EngineWork(**t[k]) for k in _ENGINE_WORK}
    t |= {k: tuple(_load_collective(c) for c in t[k]) for k in _COLLECTIVE_LISTS}
    blocks = ("layer_forward", "layer_backward", "rest_forward", "rest_backward", "optimizer")
    return StepWork(
        **{k: work(data[k]) for k in blocks},
        recompute={str(m): work(w) for m, w in data["recompute"].items()},
        modes=tuple(data["modes"]),
        micro_steps=int(data["micro_steps"]),
        traffic=Traffic(**t),
        tokens=int(data["tokens"]),
        model_flops=float(data["model_flops"]),
        pipeline=_load_pipeline(data["pipeline"]) if data.get("pipeline") else None,
    )


def _load_pipeline(d: dict) -> PipelineWork:
    return PipelineWork(
        layers_per_rank=tuple(d["layers_per_rank"]),
        stages_per_rank=int(d["stages_per_rank"]),
        microbatches=int(d["microbatches"]),
        send=Collective(**d["send"]),
    )


def cpu_threads(recipe: Recipe, threads: int | None) -> int:
    """The threads per process a CPU run of ``recipe`` gets: ``threads``, else ljperf's launcher's share."""
    return threads or max(1, (os.cpu_count() or 1) // recipe.world)


def device_rates(recipe: Recipe, *, device_name: str | None, threads: int | None = None) -> SpeedRates | None:
    """The uncalibrated rates of the device ``recipe`` runs on (None: an unknown GPU)."""
    if recipe.device == "cpu":
        return cpu_rates(threads=cpu_threads(recipe, threads), processes=recipe.world)
    return gpu_rates(device_name) if device_name else None


def bf16_peak(recipe: Recipe) -> bool:
    """Whether MFU applies: a GPU's bf16 datasheet peak for a run that computes in bf16."""
    return recipe.device == "cuda" and recipe.precision != "fp32"
