"""The forecast a benchmark records beside its measured peak (``results.forecast``), its printed line, and the
check that a CPU run fits the RAM before it starts.

Run: any ``ljperf benchmark ...``; the record then feeds ``ljperf plan --calibrate``. A failure only warns.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from ljperf.errors import describe

if TYPE_CHECKING:
    from ljperf.runtime import RunContext


def benchmark_forecast(run: RunContext, results: dict[str, Any], plan: tuple[str, ...] | None) -> dict[str, Any] | None:
    """Forecast the run's recipe and compare with ``results.peak_allocated_bytes``; None (and a warning) on failure."""
    from ljperf.forecast.api import forecast
    from ljperf.forecast.recipe import Recipe

    try:
        recipe = Recipe.from_run(run, recompute=tuple(plan or ()))
        result = forecast(run.model, recipe, device_name=run.device.calibration_name)
    except Exception as exc:  # a forecast must never fail a benchmark
        from ljperf.report import warn  # report imports this module

        warn(f"no memory forecast for this run ({describe(exc)})")
        return None
    out: dict[str, Any] = {
        "peak_allocated_bytes": result.peak_allocated_bytes,
        "traced_peak_allocated_bytes": result.traced_peak_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "breakdown": result.breakdown,
        "phase": result.phase,
        "source": result.source,
        "calibration_name": run.device.calibration_name,
        "error_pct": None,
    }
    measured = results.get("peak_allocated_bytes")
    if measured:
        out["error_pct"] = round(100 * (result.peak_allocated_bytes - measured) / measured, 2)
    return out


def check_host_memory(run: RunContext, plan: tuple[str, ...] | None) -> None:
    """On CPU, raise ``MemoryError`` (the run ends as ``oom``, its record written) when the forecast peak of this
    node's processes is over the RAM available. The kernel would kill the run later, with no record and no
    message: ``torch/llama3-8b`` on a 24 GiB machine died after 85 s of building the model. Rank 0 decides, so
    every rank agrees. On CUDA an out-of-memory error is caught and recorded, and nothing is refused here."""
    from ljperf import hardware
    from ljperf.checkpoint.solver import ordered_plan, shared_from_rank0
    from ljperf.forecast.api import forecast
    from ljperf.forecast.cli import max_micro_batch
    from ljperf.forecast.recipe import Recipe
    from ljperf.runtime import local_world_size
    from ljperf.units import format_bytes

    if run.device.type != "cpu":
        return

    def refusal(ram: int) -> str | None:
        spec, local = run.model, local_world_size(run.launch.nproc_per_node)
        recipe = Recipe.from_run(run, recompute=tuple(plan or ()))
        peak = forecast(spec, recipe).peak_allocated_bytes
        if peak * local <= ram:
            return None
        full = recipe.with_(recompute=ordered_plan(spec.layers, spec.layers, 0))
        if forecast(spec, full).peak_allocated_bytes * local <= ram:
            fix = "--recompute auto would fit"
        elif batch := max_micro_batch(spec, full, ram // local, device_name=None):
            fix = f"--recompute full with --micro-batch {batch} would fit"
        else:
            fix = "even one sequence with --recompute full would not fit: a smaller model or --seq-len"
        return (
            f"forecast {format_bytes(peak)} per process × {local} on this node > {format_bytes(ram)} of RAM "
            f"available: not started, the kernel would kill it; {fix}"
        )

    reason = None
    if run.is_main and (ram := hardware.available_ram()) is not None:
        with contextlib.suppress(Exception):  # no forecast, no refusal: the record's forecast warns of it
            reason = refusal(ram)
    if (reason := shared_from_rank0(reason)) is not None:
        raise MemoryError(reason)


def forecast_line(results: dict[str, Any]) -> str | None:
    """``memory forecast 30.94 MiB (peak at optimizer step) vs measured 30.94 MiB (+0.0%)``, or None without a
    forecast."""
    from ljperf.units import format_bytes

    fc = results.get("forecast")
    if not fc:
        return None
    text = f"memory forecast {format_bytes(fc['peak_allocated_bytes'])} (peak at {fc['phase']})"
    if fc["error_pct"] is not None:
        text += f" vs measured {format_bytes(results['peak_allocated_bytes'])} ({fc['error_pct']:+.1f}%)"
    return text
