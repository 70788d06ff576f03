"""The spread of a repeated measurement, and a ratio of two that says when their repeats overlap (``≈``).

Use: ``ratio(Spread.of([9.1, 8.7, 9.4]), Spread.of([7.2, 7.9, 7.0]), reference="eager")``, shown by
``format_ratio`` as ``×1.28``, or ``×1.02 ≈`` when the two min–max ranges overlap: the repeats do not separate
them, so the difference is not shown. ``ljperf ablation`` and ``ljperf compile-report`` mark ratios alike.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

OVERLAP = "≈"
OVERLAP_NOTE = f"{OVERLAP}: the min–max ranges of the two overlap; these repeats do not show a difference."


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Median and range of one figure over the successful repeats, and their mean and count."""

    median: float
    low: float
    high: float
    mean: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        if not values:
            return None
        median, mean = statistics.median(values), statistics.fmean(values)
        return cls(median=median, low=min(values), high=max(values), mean=mean, count=len(values))

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high


@dataclass(frozen=True, kw_only=True)
class Ratio:
    """``value`` = median of one figure / median of the reference; ``overlaps``: their ranges overlap."""

    value: float
    reference: str
    overlaps: bool


def ratio(of: Spread | None, to: Spread | None, *, reference: str) -> Ratio | None:
    if of is None or to is None:
        return None
    return Ratio(value=of.median / to.median, reference=reference, overlaps=of.overlaps(to))


def format_ratio(r: Ratio | None) -> str:
    """``×1.28``, ``×1.02 ≈`` where the ranges overlap, ``-`` where there is no ratio."""
    if r is None:
        return "-"
    return f"×{r.value:.2f}" + (f" {OVERLAP}" if r.overlaps else "")


def format_spread(s: Spread | None, scale: float = 1.0, spec: str = ",.0f") -> tuple[str, str]:
    """(median, "min–max") as text, each value times ``scale`` in ``spec``'s format."""
    if s is None:
        return "-", "-"
    return format(s.median * scale, spec), f"{format(s.low * scale, spec)}–{format(s.high * scale, spec)}"
