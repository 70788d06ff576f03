"""The forecast a benchmark records beside its measured peak (``results.forecast``), its printed line, and the
check before a run starts that it fits the RAM (CPU: refused if not) or the GPU (a warning).

Run: any ``ljperf benchmark ...``; the record then feeds ``ljperf plan --calibrate``. A failure only warns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ljperf.core import hardware
from ljperf.core.console import warn
from ljperf.core.errors import describe
from ljperf.core.plans import Plan
from ljperf.core.units import format_bytes
from ljperf.distributed.collectives import shared_from_rank0
from ljperf.distributed.launch import local_world_size
from ljperf.forecast.advice import dominant_term
from ljperf.forecast.api import forecast, max_micro_batch
from ljperf.forecast.recipe import Recipe
from ljperf.recompute.solver import advice, ordered_plan
from ljperf.run.context import RunContext


def benchmark_forecast(run: RunContext, results: dict[str, Any], plan: Plan | None) -> dict[str, Any] | None:
    """Forecast the run's recipe and compare with ``results.peak_allocated_bytes``; None (and a warning) on failure."""
    try:
        recipe = Recipe.from_run(run, recompute=tuple(plan or ()))
        result = forecast(run.model, recipe, device_name=run.device.calibration_name)
    except Exception as exc:  # a forecast must never fail a benchmark
        warn(f"no memory forecast for this run ({describe(exc)})")
        return None
    out: dict[str, Any] = {
        "peak_allocated_bytes": result.peak_allocated_bytes,
        "traced_peak_allocated_bytes": result.traced_peak_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "breakdown": result.breakdown,
        "phase": result.phase,
        "source": result.source,
        "analytic_reason": result.analytic_reason,
        "calibration_name": run.device.calibration_name,
        "error_pct": None,
    }
    measured = results.get("peak_allocated_bytes")
    if measured:
        out["error_pct"] = round(100 * (result.peak_allocated_bytes - measured) / measured, 2)
    if result.stage_peaks:  # --pp: each pipeline rank's forecast beside its measured peak
        out["peak_allocated_bytes_per_pp_rank"] = list(result.stage_peaks)
        each = (results.get("pipeline") or {}).get("peak_allocated_bytes_per_pp_rank") or []
        out["error_pct_per_pp_rank"] = [
            round(100 * (f - m) / m, 2) if m else None for f, m in zip(result.stage_peaks, each, strict=False)
        ]
    return out


def check_memory(run: RunContext, plan: Plan | None) -> bool:
    """Before the engine is built, compare the forecast peak with the memory the run has; True where this rank
    forecast the recipe (rank 0, the memory known): the record's forecast then costs milliseconds, not a trace.

    CPU: raise ``MemoryError`` (the run ends as ``oom``, its record written) when this node's processes would
    need more than the RAM available. The kernel would kill the run later with no record and no message:
    ``torch/llama3-8b`` on a 24 GiB machine died after 85 s of building the model. Rank 0 decides for all.
    CUDA: rank 0 warns when the allocated peak alone is over the GPU's memory (an out-of-memory error is caught
    and recorded, and the forecast may be uncalibrated there, so the run goes on)."""
    name = run.device.calibration_name
    if run.device.type == "cuda":
        total = torch.cuda.get_device_properties(run.device.torch_device).total_memory
        if run.is_main and (short := shortfall(run, plan, memory=total, processes=1, device_name=name)):
            warn(f"{short[0]} of GPU memory: expect out of memory; {short[1]}")
        return run.is_main
    reason, forecast_made = None, False
    if run.is_main and (ram := hardware.available_ram()) is not None:
        local = local_world_size(run.launch.nproc_per_node)
        if short := shortfall(run, plan, memory=ram, processes=local, device_name=name):
            reason = f"{short[0]} of RAM available: not started, the kernel would kill it; {short[1]}"
        forecast_made = True
    if (reason := shared_from_rank0(reason)) is not None:
        raise MemoryError(reason)
    return forecast_made


def _longest_fitting_seq(recipe: Recipe, share: int, peak: Callable[[Recipe], int]) -> int | None:
    """The longest halving of ``recipe``'s sequence (down to 32 tokens) that fits ``share`` as it is, without
    recompute: on a CPU, where a recomputed billion-parameter step takes minutes, the fix a user can run."""
    seq = recipe.seq_len // 2
    while seq >= 32:
        if peak(recipe.with_(seq_len=seq, recompute=())) <= share:
            return seq
        seq //= 2
    return None


def shortfall(
    run: RunContext, plan: Plan | None, *, memory: int, processes: int, device_name: str | None
) -> tuple[str, str] | None:
    """None when ``processes`` of ``run`` (with ``plan``) fit ``memory`` bytes by the forecast's allocated peak,
    calibrated for ``device_name`` as the record's forecast is (or there is no forecast: the record's warns of
    it), on CPU with ``hardware.HOST_MARGIN`` added to each; else ("forecast X per process × N[: the RAM that
    takes] > Y", what would fit)."""
    cpu = run.device.type != "cuda"
    spec, share = run.model, hardware.ram_share(memory, processes=processes) if cpu else memory // processes

    def peak(recipe: Recipe) -> int:
        return forecast(spec, recipe, device_name=device_name).peak_allocated_bytes

    try:
        recipe = Recipe.from_run(run, recompute=tuple(plan or ()))
        result = forecast(spec, recipe, device_name=device_name)
        if (needed := result.peak_allocated_bytes) <= share:
            return None
        full_plan = ordered_plan(spec.layers, spec.layers, 0)
        full = recipe.with_(recompute=full_plan)
        if peak(full) <= share:
            fix = "--recompute auto would fit"
        elif not cpu:  # more GPUs add memory; on CPU more processes share the same RAM
            fix = "with --recompute full, " + "; ".join(
                advice(recipe, share, lambda r: peak(r.with_(recompute=full_plan)))
            )
        elif batch := max_micro_batch(spec, full, share, device_name=device_name):
            fix = f"--recompute full with --micro-batch {batch} would fit"
        else:
            fix = "even one sequence with --recompute full would not fit: a smaller model or --seq-len"
        if cpu and (shorter := _longest_fitting_seq(recipe, share, peak)):
            fix += f"; faster on a CPU: --seq-len {shorter} without recompute"
        if dominant := dominant_term(spec, recipe, result, device_name=device_name):
            fix = f"{dominant}; {fix}"
    except Exception:  # a forecast must never fail a benchmark
        return None
    head = f"forecast {format_bytes(needed)} per process × {processes}"
    if cpu:
        ram = hardware.host_ram_needed(needed, processes=processes)
        head += f": {format_bytes(ram)} with what a process holds beyond its tensors (5% and 256 MiB)"
    return f"{head} > {format_bytes(memory)}", fix
