"""The forecast a benchmark records beside its measured peak (``results.forecast``), and its printed line.

Run: any ``ljperf benchmark ...``; the record then feeds ``ljperf plan --calibrate``. A failure only warns.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

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
        warnings.warn(f"ljperf: no memory forecast for this run ({type(exc).__name__}: {exc})", stacklevel=2)
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
