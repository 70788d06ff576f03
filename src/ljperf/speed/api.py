"""The step-time model as ``ljperf plan`` and ``ljperf benchmark`` use it: a recipe's predicted speed on a device,
with the terms calibrated for it, and the record a benchmark keeps beside its measured steps.

Run: ``speed_for(spec, recipe, device_name="H100", cluster=Cluster())`` → ``Speed``, or None for a device it
knows no rates of; ``benchmark_speed(...)`` → the record's ``results.speed``.
"""

from __future__ import annotations

from typing import Any

from ljperf.forecast.recipe import Recipe
from ljperf.models.spec import ModelSpec
from ljperf.speed.calibrate import calibrated, device_seconds
from ljperf.speed.rates import Cluster, with_cluster
from ljperf.speed.step_time import Speed, StepWork, bf16_peak, device_rates, predict, step_work


def speed_work(
    spec: ModelSpec, recipe: Recipe, *, device_name: str | None, cluster: Cluster, threads: int | None = None
) -> tuple[Speed, StepWork] | None:
    """``recipe``'s predicted speed and its work, on the device's calibrated rates (the flags' links win)."""
    rates = device_rates(recipe, device_name=device_name, threads=threads)
    if rates is None:
        return None
    rates = with_cluster(calibrated(rates), cluster)
    work = step_work(spec, recipe, rates)
    return predict(work, rates, peak_mfu=bf16_peak(recipe)), work


def speed_for(
    spec: ModelSpec, recipe: Recipe, *, device_name: str | None, cluster: Cluster, threads: int | None = None
) -> Speed | None:
    found = speed_work(spec, recipe, device_name=device_name, cluster=cluster, threads=threads)
    return None if found is None else found[0]


def benchmark_speed(
    spec: ModelSpec, recipe: Recipe, *, device_name: str, threads: int, results: dict[str, Any]
) -> dict[str, Any] | None:
    """``results.speed`` of a benchmark: the prediction beside the measured step (``calibrate.device_seconds``),
    the rates, and the work (what ``ljperf plan --calibrate`` fits the rates to); None for a device without
    rates."""
    found = speed_work(spec, recipe, device_name=device_name, cluster=Cluster(), threads=threads)
    if found is None:
        return None
    speed, work = found
    cpu = recipe.device == "cpu"
    measured = device_seconds(results, threads=threads if cpu else None)
    error = round(100 * (speed.step_time_s - measured) / measured, 2) if measured else None
    return {
        "predicted_step_time_s": speed.step_time_s,
        "measured_step_time_s": measured,
        "error_pct": error,
        "measured": "process CPU time per thread" if cpu else "wall",
        "threads": threads if cpu else None,
        "calibrated": speed.calibrated,
        "breakdown": speed.breakdown,
        "rates": speed.rates,
        "work": work.record(),
    }
