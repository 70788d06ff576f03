"""``--recompute auto``: the solver's plan fits the budget in a real run; an impossible budget exits 2."""

from __future__ import annotations

import pytest
from tests.conftest import read_record, run_ljperf

from ljperf import models
from ljperf.forecast import Recipe, forecast

SHAPE = ("--seq-len", "512", "--micro-batch", "2")


def forecasts() -> tuple[int, int]:
    spec = models.resolve(name="llama-tiny")
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=512)
    return tuple(forecast(spec, recipe.with_(recompute=(m,) * spec.layers)).device_bytes for m in ("none", "full"))


@pytest.mark.slow
def test_auto_plan_fits_the_budget_in_a_real_run(tmp_path):
    none, full = forecasts()
    budget = (none + full) // 2
    out = tmp_path / "r.json"
    proc = run_ljperf(
        "benchmark", "--model", "torch/llama-tiny", *SHAPE, "--steps", "1", "--warmup", "2",
        "--recompute", "auto", "--memory-budget", str(budget), "--output", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = read_record(out)["results"]
    plan = results["recompute"]["plan"]
    assert results["recompute"]["fits"] and results["recompute"]["forecast_peak_bytes"] <= budget
    assert 0 < plan.count("none") < len(plan) or "selective" in plan
    assert results["peak_allocated_bytes"] <= budget  # measured, not forecast
    assert "recomputing" in proc.stdout


def test_budget_nothing_fits_exits_2_with_advice():
    proc = run_ljperf(
        "benchmark", "--model", "torch/llama-tiny", *SHAPE, "--recompute", "auto", "--memory-budget", "1MiB"
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "does not fit" in proc.stderr
