"""Throughput metrics from step times: tokens/s, TFLOPS, MFU (definitions in docs/metrics.md)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Steady-state figures of a run."""

    step_time_s_p50: float
    step_time_s_p90: float
    step_time_s_mean: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float | None
    hfu: float | None


def throughput(
    step_times: list[float],
    *,
    tokens_per_step: int,
    world: int,
    flops_per_token: float,
    recompute_flops_per_token: float = 0.0,
    peak_tflops: float | None,
) -> Throughput:
    """Figures from measured step times. ``tokens_per_step`` is global (all ranks, all micro-steps).

    Throughput uses the median step time, robust to the odd slow step (GC, a noisy neighbour).
    MFU counts model FLOPs only; HFU adds the forward FLOPs that activation recompute repeats.
    """
    p50 = percentile(step_times, 50)
    tokens_per_s = tokens_per_step / p50
    per_device = tokens_per_s / world
    tflops = per_device * flops_per_token / 1e12
    hw_tflops = per_device * (flops_per_token + recompute_flops_per_token) / 1e12
    return Throughput(
        step_time_s_p50=p50,
        step_time_s_p90=percentile(step_times, 90),
        step_time_s_mean=statistics.fmean(step_times),
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_device=per_device,
        tflops_per_device=tflops,
        mfu=tflops / peak_tflops if peak_tflops else None,
        hfu=hw_tflops / peak_tflops if peak_tflops else None,
    )
