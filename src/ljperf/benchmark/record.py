"""The JSON record of a benchmark run (schema in docs/results.md): its configuration, and the results every rank
contributes to, also rebuilt from rank 0's progress lines when rank 0 died before writing it.

Run: ``new_record(cfg, run)`` when the run starts; ``results_section(...)`` on every rank when it ends.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ljperf.benchmark.breakdown import breakdown, over_ranks
from ljperf.benchmark.metrics import Throughput, throughput
from ljperf.compile.regional import session
from ljperf.core import hardware
from ljperf.core.choices import DeviceType, OptimizerImpl
from ljperf.core.console import warn
from ljperf.core.errors import describe
from ljperf.core.options import LaunchConfig, default_adamw_impl
from ljperf.core.plans import Plan
from ljperf.core.records import record_header
from ljperf.distributed.launch import local_world_size, under_torchrun
from ljperf.distributed.memory import MemoryStats
from ljperf.forecast.pipeline import bubble_fraction
from ljperf.forecast.recipe import Recipe
from ljperf.run.config import RunConfig
from ljperf.run.context import RunContext, unjoined
from ljperf.speed.api import benchmark_speed


@dataclass
class LoopState:
    """What the loop has measured so far; kept when a run fails half-way."""

    losses: list[torch.Tensor] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_cpu_times: list[float] = field(default_factory=list)
    """This process's CPU seconds (user + system, all its threads) in each timed step: on a shared CPU, the
    work without the time spent waiting for a core."""
    memory: MemoryStats | None = None
    """This rank's memory (None until a step is measured; CUDA: read again when the loop ends)."""
    recompute: Any = None
    """The recompute plan running (``checkpoint.solver.Decision``; the closed loop may replace it)."""
    closed_loop: dict | None = None
    phase_seconds: list[dict[str, float]] = field(default_factory=list)
    """The timed steps' seconds by phase (``core.phases.PhaseClock.seconds``)."""
    profile: dict | None = None
    """``--profile``: this rank's ``results.profile`` and its profiled steps' seconds by part."""
    forecast_made: bool = False
    """The memory check forecast the recipe before the run: a record written after a signal (torchrun's SIGTERM
    once a peer failed, a Ctrl-C) keeps the forecast too, repeated from the trace cache in milliseconds."""


def new_record(cfg: RunConfig, run: RunContext) -> dict[str, Any]:
    spec = cfg.model
    train = cfg.train
    tokens_per_step = train.micro_batch * train.resolved_seq_len * train.grad_accum * run.mesh.dp
    return {
        **record_header("benchmark", args=cfg.argv, devices=[run.device.name], world_size=run.world),
        "config": {
            "model": {
                "name": spec.name,
                "architecture": spec.architecture,
                "params": spec.params.total,
                "params_active": spec.params.active,
                "params_embedding": spec.params.embedding,
                "layers": spec.layers,
                "hidden": spec.hidden,
                "heads": spec.heads,
                "kv_heads": spec.kv_heads,
                "vocab": spec.vocab,
                "flops_per_token": spec.flops_per_token(train.resolved_seq_len),
            },
            "engine": {"name": cfg.engine},
            "train": asdict(train),
            "optimizations": {**asdict(cfg.optim), "optimizer_impl": _optimizer_impl(cfg, run.device.type)},
            "launch": launch_record(cfg.launch, world=run.world),
            "mesh": run.mesh.record(),
            "tokens_per_step": tokens_per_step,
        },
    }


def _optimizer_impl(cfg: RunConfig, device_type: DeviceType) -> OptimizerImpl | None:
    """The AdamW implementation that ran: ``--optimizer-impl``, else the default (None: DeepSpeed's config)."""
    if cfg.engine == "deepspeed":
        return None
    return cfg.optim.optimizer_impl or default_adamw_impl(device_type)


def launch_record(launch: LaunchConfig, *, world: int) -> dict[str, Any]:
    """The record's ``launch``: the flags, with the processes per node and nodes a user's torchrun started."""
    record = {**asdict(launch), "world_size": world}
    if under_torchrun():  # ljperf's launcher sets the same numbers; a user's torchrun did not pass them as flags
        local = local_world_size(world)
        record |= {"nproc_per_node": local, "nnodes": max(1, world // local)}
    return record


def results_section(
    cfg: RunConfig,
    run: RunContext,
    state: LoopState,
    *,
    status: str,
    reason: str | None,
    recompute_flops_per_token: float = 0.0,
) -> dict[str, Any]:
    """The ``results`` of the record; all ranks call it (it gathers when the run is healthy)."""
    healthy = status == "ok" and dist.is_initialized()
    losses = [float(x) for x in _mean_over_ranks(state.losses, healthy)]
    out: dict[str, Any] = {
        "status": status,
        "reason": reason,
        "steps_completed": len(state.step_times),
        "losses": losses,
        "step_times_s": state.step_times,
        "step_cpu_times_s": state.step_cpu_times,
        **memory_results(_per_rank_memory(run, state, healthy)),
        "memory_method": state.memory.method if state.memory is not None else None,
    }
    # A run that timed no step has every figure, each null (it lacked the mean, HFU and the peak used).
    figures: dict[str, Any] = dict.fromkeys([f.name for f in fields(Throughput)] + ["peak_tflops_per_device"])
    if state.step_times:
        train = cfg.train
        # The peak table holds dense bf16 figures: no MFU for fp32 or CPU unless --peak-tflops says.
        known = hardware.peak_tflops(run.device.name) if run.device.type == "cuda" and run.bf16 else None
        peak = train.peak_tflops or known
        figures = asdict(
            throughput(
                state.step_times,
                # a tensor-parallel group's ranks share their sequences: its tokens count once
                tokens_per_step=train.micro_batch * train.resolved_seq_len * train.grad_accum * run.mesh.dp,
                world=run.world,
                flops_per_token=cfg.model.flops_per_token(train.resolved_seq_len),
                recompute_flops_per_token=recompute_flops_per_token,
                peak_tflops=peak,
            )
        ) | {"peak_tflops_per_device": peak}
    if cfg.optim.compile_mode != "off":
        out["compile"] = sess.results() if (sess := session()) is not None else None
    if run.mesh.pp > 1:
        out["pipeline"] = pipeline_results(run, out["peak_allocated_bytes_per_rank"])
    out |= explained(cfg, run, state, healthy=healthy)
    return {**figures, **out}


def pipeline_results(run: RunContext, per_rank: list[int | None]) -> dict[str, Any]:
    """``--pp``: each pipeline rank's peak (the highest of its ranks) and the schedule's bubble, the share of the
    pipeline's time its ranks sit idle filling and draining (``forecast.pipeline.bubble_fraction``)."""
    shape, opts = run.mesh, run.engine_opts
    stage_peaks: list[int | None] = []
    for pp_rank in range(shape.pp):
        mine = [p for rank, p in enumerate(per_rank) if shape.pp_rank(rank) == pp_rank and p is not None]
        stage_peaks.append(max(mine, default=None))
    bubble = bubble_fraction(pp=shape.pp, microbatches=run.train.grad_accum, stages_per_rank=opts.pp_stages_per_rank)
    return {"peak_allocated_bytes_per_pp_rank": stage_peaks, "bubble_fraction": bubble}


def speed_section(run: RunContext, results: dict[str, Any], plan: Plan | None) -> dict[str, Any] | None:
    """``results.speed``: the step-time model's prediction of the run's recipe beside its median measured step
    (docs/speed.md); None for a device without rates, or (with a warning) when the prediction failed."""
    try:
        recipe = Recipe.from_run(run, recompute=tuple(plan or ()))
        return benchmark_speed(
            run.model,
            recipe,
            device_name=run.device.calibration_name,
            threads=torch.get_num_threads(),
            results=results,
        )
    except Exception as exc:  # a prediction must never fail a benchmark
        warn(f"no step-time prediction for this run ({describe(exc)})")
        return None


PROFILE_FILES = ("traces", "memory_snapshots")
"""``results.profile``'s lists of the files every rank wrote (a file a rank could not write is not listed)."""


def explained(cfg: RunConfig, run: RunContext, state: LoopState, *, healthy: bool) -> dict[str, Any]:
    """``breakdown`` (every run: the profiled steps' with ``--profile``, else the timed steps') and ``profile``
    (its files and steps), gathered from the ranks when the run is healthy."""
    if state.profile is not None and state.profile["steps"] is not None:
        mine = breakdown(state.profile["steps"], source="profiler", world=run.world)
    else:  # no --profile, or its trace could not be written
        mine = breakdown(state.phase_seconds, source="timers", world=run.world)
    out: dict[str, Any] = {"breakdown": over_ranks(_gathered(run, mine, healthy))}
    if cfg.explain.profile is not None:
        each = _gathered(run, (state.profile or {}).get("written", {}), healthy)
        written = {kind: [path for files in each for path in files.get(kind, [])] for kind in PROFILE_FILES}
        out["profile"] = {"folder": cfg.explain.profile, **written, **(state.profile or {}).get("record", {})}
    return out


def _gathered(run: RunContext, mine: Any, healthy: bool) -> list[Any]:
    """Every rank's ``mine`` (a failed run: this rank's alone)."""
    if not (healthy and run.world > 1):
        return [mine]
    each: list[Any] = [None] * run.world
    dist.all_gather_object(each, mine)
    return each


def _mean_over_ranks(losses: list[torch.Tensor], healthy: bool) -> list[float]:
    if not losses:
        return []
    stacked = torch.stack(losses).float()
    if healthy and dist.get_world_size() > 1:
        dist.all_reduce(stacked)
        stacked /= dist.get_world_size()
    return stacked.tolist()


MEMORY_FIELDS = {
    "peak_allocated_bytes": "peak_allocated",
    "peak_reserved_bytes": "peak_reserved",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
}
"""The record's memory figures and the ``MemoryStats`` field each is read from."""


def memory_results(per_rank: list[MemoryStats | None]) -> dict[str, Any]:
    """Each of ``MEMORY_FIELDS``: its maximum over the ranks, and ``*_per_rank`` (null where a rank's is unknown, and
    on CPU for what only CUDA's allocator counts)."""
    out: dict[str, Any] = {}
    for key, attr in MEMORY_FIELDS.items():
        column = [None if stats is None else getattr(stats, attr) for stats in per_rank]
        out[key] = max((x for x in column if x is not None), default=None)
        out[f"{key}_per_rank"] = column
    return out


def _per_rank_memory(run: RunContext, state: LoopState, healthy: bool) -> list[MemoryStats | None]:
    """One entry per rank; a failed run knows only its own (the others are None)."""
    gathered: list[MemoryStats | None] = [None] * run.world
    if healthy and run.world > 1:
        dist.all_gather_object(gathered, state.memory)
    else:
        gathered[run.rank] = state.memory
    return gathered


def results_from_progress(cfg: RunConfig, progress: Path) -> dict[str, Any]:
    """The record of a run whose rank 0 died before writing one: the steps and the peak its progress lines show."""
    run = unjoined(cfg, world=cfg.launch.nproc_per_node * cfg.launch.nnodes)
    record = new_record(cfg, run)
    state = LoopState()
    lines = progress.read_text().splitlines() if progress.exists() else []
    for line in lines:
        entry = json.loads(line)
        step, seconds = entry.get("step"), entry.get("time_s")
        if step is not None and seconds is not None and cfg.train.warmup <= step < cfg.train.warmup + cfg.train.steps:
            state.step_times.append(seconds)
            state.losses.append(torch.tensor(entry["loss"]))
        if "peaks" in entry:  # the measured step's memory: rank 0's, the figure a record from its end would hold
            state.memory = MemoryStats(**entry["peaks"])
    record["results"] = results_section(cfg, run, state, status="error", reason=None)
    return record
