"""Statistics of an ablation: per-variant median and min–max, speedup vs the baseline, incremental gain.

Throughput ratios use median tokens/s: the median run's (the slower of the middle two for an even count),
whose step time and MFU the table shows beside it. A ratio is marked as within noise when the min–max ranges of the
two variants overlap: the repeats do not separate them, so the difference is not shown (``core.spread``).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from ljperf.ablation.variants import LOCAL_ENV
from ljperf.core.spread import Ratio, Spread, ratio


@dataclass(kw_only=True)
class VariantStats:
    """One variant in one environment, over its repeats."""

    environment: str
    variant: str
    flags: str
    runs: int
    statuses: dict[str, int]
    reason: str | None = None
    """The first failure's reason, if any run failed."""
    tokens_per_s: Spread | None = None
    step_time_s: Spread | None = None
    peak_allocated_bytes: Spread | None = None
    mfu: Spread | None = None
    wall_s: Spread | None = None
    """Wall time of the whole run (start-up, compile, warm-up, steps)."""
    losses: list[float] = field(default_factory=list)
    """The loss curve of the first successful repeat."""
    loss_max_abs_diff: float | None = None
    """Largest loss difference from the baseline's curve (same seed and data: should be ~0)."""
    speedup: Ratio | None = None
    """Throughput vs the baseline (first variant of the first environment)."""
    gain: Ratio | None = None
    """Throughput vs the previous variant of the same environment (the added optimization's share)."""
    predicted_step_s: float | None = None
    """The step-time model's step (``results.speed``), the median over the runs; None where none predicted."""
    predicted_error_pct: float | None = None
    """Its error against the measured step (``results.speed.error_pct``), the median over the runs."""
    predicted_against_s: float | None = None
    """The measured step the model is compared with where it is not the wall time of ``step_time_s``: a CPU's
    process time per thread (``results.speed.measured_step_time_s``), the median over the runs; else None."""

    @property
    def label(self) -> str:
        return self.variant if self.environment == LOCAL_ENV else f"{self.environment}/{self.variant}"


def summarize(records: list[dict[str, Any]]) -> list[VariantStats]:
    """Group run records by (environment, variant) in plan order and compute every figure."""
    groups: dict[tuple[int, int, str, str], list[dict]] = {}
    for rec in records:
        meta = rec["ablation"]
        key = (meta["environment_index"], meta["variant_index"], meta["environment"]["name"], meta["variant"])
        groups.setdefault(key, []).append(rec)
    out = [_one(runs) for _, runs in sorted(groups.items())]
    contributions(out)
    return out


def _one(runs: list[dict]) -> VariantStats:
    runs = sorted(runs, key=lambda r: r["ablation"]["repeat"])
    meta = runs[0]["ablation"]
    ok = [r["results"] for r in runs if r["results"]["status"] == "ok"]
    failed = [r["results"] for r in runs if r["results"]["status"] != "ok"]

    def spread(key: str) -> Spread | None:
        return Spread.of([res[key] for res in ok if res.get(key) is not None])

    # Throughput, step time and MFU come from one run, the median by tokens/s (the slower of the middle two
    # for an even count): medians taken apart, a noisy pair showed 6,260 tokens/s beside a 324 ms step (1,581).
    timed = sorted((res for res in ok if res.get("tokens_per_s") is not None), key=lambda res: res["tokens_per_s"])
    middle = timed[(len(timed) - 1) // 2] if timed else {}

    def of_middle(key: str) -> Spread | None:
        whole = spread(key)
        if whole is None or middle.get(key) is None:
            return whole
        return replace(whole, median=middle[key])

    speeds = [res["speed"] for res in ok if isinstance(res.get("speed"), dict)]
    predicted = [x["predicted_step_time_s"] for x in speeds]
    errors = [x["error_pct"] for x in speeds if x.get("error_pct") is not None]
    cpu = [x for x in speeds if x.get("measured") != "wall" and x.get("measured_step_time_s")]
    against = [x["measured_step_time_s"] for x in cpu]
    return VariantStats(
        predicted_step_s=statistics.median(predicted) if predicted else None,
        predicted_error_pct=statistics.median(errors) if errors else None,
        predicted_against_s=statistics.median(against) if against else None,
        environment=meta["environment"]["name"],
        variant=meta["variant"],
        flags=meta["flags"],
        runs=len(runs),
        statuses=dict(Counter(r["results"]["status"] for r in runs)),
        reason=failed[0].get("reason") if failed else None,
        tokens_per_s=of_middle("tokens_per_s"),
        step_time_s=of_middle("step_time_s_p50"),
        peak_allocated_bytes=of_middle("peak_allocated_bytes"),
        mfu=of_middle("mfu"),
        wall_s=Spread.of([r["ablation"]["wall_s"] for r in runs if r["results"]["status"] == "ok"]),
        losses=(ok[0].get("losses") or []) if ok else [],
    )


def contributions(stats: list[VariantStats]) -> None:
    """Fill ``speedup`` (vs the first entry) and ``gain`` (vs the previous variant of the same environment)."""
    if not stats:
        return
    base = stats[0]
    for i, s in enumerate(stats):
        s.speedup = ratio(s.tokens_per_s, base.tokens_per_s, reference=base.label) if i else None
        prev = stats[i - 1] if i else None
        if prev is not None and prev.environment == s.environment:
            s.gain = ratio(s.tokens_per_s, prev.tokens_per_s, reference=prev.label)
        else:
            s.gain = None
        if s.losses and base.losses:
            s.loss_max_abs_diff = max(abs(a - b) for a, b in zip(s.losses, base.losses, strict=False))
