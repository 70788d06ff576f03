"""The step-time model as ``ljperf plan`` and ``ljperf benchmark`` use it: a recipe's predicted speed on a device,
with the terms calibrated for it, and the record a benchmark keeps beside its measured steps.

Run: ``speed_for(spec, recipe, device_name="H100", cluster=Cluster())`` → ``Speed``, or None for a device it
knows no rates of; ``benchmark_speed(...)`` → the record's ``results.speed``.
"""

from __future__ import annotations

import statistics
from typing import Any

from ljperf.forecast.recipe import Recipe
from ljperf.models.spec import ModelSpec
from ljperf.speed.calibrate import calibrated
from ljperf.speed.model import Speed, StepWork, bf16_peak, device_rates, predict, step_work
from ljperf.speed.rates import Cluster, with_cluster


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
    spec: ModelSpec, recipe: Recipe, *, device_name: str, threads: int, step_times: list[float]
) -> dict[str, Any] | None:
    """``results.speed`` of a benchmark: the prediction beside the median measured step, the rates, and the work
    (what ``ljperf plan --calibrate`` fits the rates to); None for a device without rates."""
    found = speed_work(spec, recipe, device_name=device_name, cluster=Cluster(), threads=threads)
    if found is None:
        return None
    speed, work = found
    measured = statistics.median(step_times) if step_times else None
    error = round(100 * (speed.step_time_s - measured) / measured, 2) if measured else None
    return {
        "predicted_step_time_s": speed.step_time_s,
        "measured_step_time_s": measured,
        "error_pct": error,
        "calibrated": speed.calibrated,
        "breakdown": speed.breakdown,
        "rates": speed.rates,
        "work": work.record(),
    }
