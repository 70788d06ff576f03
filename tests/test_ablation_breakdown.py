"""``ljperf ablation``'s report.md: each variant's step time breakdown (``results.breakdown``) beside its tokens/s,
with the change from the baseline, so "compile saved 38 ms of backward" shows; records only, milliseconds.

Run: ``.venv/bin/python -m pytest -q tests/test_ablation_breakdown.py``.
"""

from __future__ import annotations

import sys

import pytest

from ljperf.ablation import report
from ljperf.ablation.stats import summarize
from ljperf.ablation.variants import parse_variants
from ljperf.commands.ablation import check_variant
from ljperf.core.errors import UsageError


def _run(variant: str, index: int, repeat: int, *, tokens_per_s: float, ms: dict[str, float | None]) -> dict:
    """A successful run's record: what the report reads of it, with a timers breakdown of ``ms``."""
    env = {"name": "local", "python": sys.executable, "prefix": sys.prefix, "versions": {}}
    meta = {"variant": variant, "variant_index": index, "flags": "", "repeat": repeat, "environment": env}
    meta |= {"environment_index": 0, "command": ["--model", "torch/llama-tiny"], "wall_s": 1.5, "log": "x.log"}
    step_ms = sum(v for v in ms.values() if v is not None)
    breakdown = {"source": "timers", "steps": 3, "ranks": 1, "step_ms": step_ms, "ms": ms, "pct": {}, "note": None}
    results = {"status": "ok", "reason": None, "tokens_per_s": tokens_per_s, "losses": [1.0]}
    return {"ablation": meta, "results": results | {"breakdown": breakdown}}


def test_each_variant_shows_its_median_breakdown_and_its_change_from_the_baseline(tmp_path):
    """base: backward 100 and 120 ms over two repeats (median 110); compile: 72 ms, 38 ms less."""
    parts = {"forward": 50.0, "optimizer": 10.0, "communication": None, "other": 2.0}
    runs = [
        _run("base", 0, 1, tokens_per_s=1000.0, ms=parts | {"backward": 100.0}),
        _run("base", 0, 2, tokens_per_s=1000.0, ms=parts | {"backward": 120.0}),
        _run("compile", 1, 1, tokens_per_s=1400.0, ms=parts | {"forward": 30.0, "backward": 72.0}),
    ]
    report.render(tmp_path, runs, command=None)
    text = (tmp_path / "report.md").read_text()
    assert "## Step time breakdown" in text
    rows = [line for line in text.splitlines() if line.startswith(("| base |", "| compile |"))]
    base_row, compile_row = rows[-2:]  # after the main table's rows
    assert base_row == "| base | 1,000 | 50.0 | 110.0 | 10.0 | - | 2.0 | 172.0 | timers |"
    assert compile_row == (
        "| compile | 1,400 | 30.0 (-20.0) | 72.0 (-38.0) | 10.0 (+0.0) | - | 2.0 (+0.0) | 114.0 (-58.0) | timers |"
    )


def test_runs_without_a_breakdown_add_no_section(tmp_path):
    run = _run("base", 0, 1, tokens_per_s=1000.0, ms={})
    del run["results"]["breakdown"]
    assert report.breakdown_section([run], summarize([run])) == []


@pytest.mark.parametrize("flag", ["--profile prof/", "--plot mem.png"])
def test_a_variant_with_profile_or_plot_is_refused(flag):
    (variant,) = parse_variants(None, [f"x={flag}"])
    with pytest.raises(UsageError, match="--profile and --plot are for one run"):
        check_variant(["--model", "torch/llama-tiny", "--device", "cpu"], variant)
