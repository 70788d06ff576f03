"""``--recompute auto``: the solver's plan fits the budget in a real run; an impossible budget exits 2."""

from __future__ import annotations

import pytest

from ljperf.forecast import Recipe, forecast
from ljperf.models.spec import resolve
from ljperf.recompute.solver import Decision

from conftest import read_record, run_main, stale_calibration_cache

SHAPE = ("--seq-len", "512", "--micro-batch", "2")


def forecasts() -> tuple[int, int]:
    spec = resolve(name="llama-tiny")
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=512)
    return tuple(forecast(spec, recipe.with_(recompute=(m,) * spec.layers)).device_bytes for m in ("none", "full"))


@pytest.mark.slow
def test_auto_plan_fits_the_budget_in_a_real_run(tmp_path, capsys):
    none, full = forecasts()
    budget = (none + full) // 2
    out = tmp_path / "r.json"
    code, stdout, stderr = run_main(
        capsys, "benchmark", "--model", "torch/llama-tiny", *SHAPE, "--steps", "1", "--warmup", "2",
        "--recompute", "auto", "--memory-budget", str(budget), "--output", str(out),
    )  # fmt: skip
    assert code == 0, stderr[-2000:]
    results = read_record(out)["results"]
    plan = results["recompute"]["plan"]
    assert results["recompute"]["fits"] and results["recompute"]["forecast_peak_bytes"] <= budget
    assert 0 < plan.count("none") < len(plan) or "selective" in plan
    assert results["peak_allocated_bytes"] <= budget  # measured, not forecast
    assert "recomputing" in stdout
    # On CPU the closed loop needs --warmup 3 (its plan's first step is measured before timing): off, and said.
    assert "closed_loop" not in results["recompute"]
    assert "closed loop off: it needs --warmup 3 or more here" in stdout


def test_budget_nothing_fits_exits_2_with_advice(capsys):
    argv = ["benchmark", "--model", "torch/llama-tiny", *SHAPE, "--recompute", "auto", "--memory-budget", "1MiB"]
    code, _, stderr = run_main(capsys, *argv)
    assert code == 2, stderr[-2000:]
    assert "does not fit" in stderr


@pytest.mark.slow
def test_closed_loop_replans_from_the_measured_peak(tmp_path, monkeypatch, capsys):
    """A stale calibration (CPU scale 1.25) makes the first plan recompute layers that fit without it; the closed
    loop measures step 2, re-plans before the timed steps, and the run's measured peak and losses are the
    no-recompute run's (which fits the budget)."""
    cache = stale_calibration_cache(tmp_path, scale=1.25)
    none, full = forecasts()
    budget = round(1.1 * none)  # the true no-recompute peak fits; ×1.25 it does not, full recompute does
    assert 1.25 * full < budget < 1.25 * none
    args = ("benchmark", "--model", "torch/llama-tiny", *SHAPE, "--steps", "2", "--warmup", "3")
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(cache))
    runs, stdout = {}, {}
    for name, extra in (("auto", ("--recompute", "auto", "--memory-budget", str(budget))), ("plain", ())):
        code, stdout[name], stderr = run_main(capsys, *args, *extra, "--output", str(tmp_path / f"{name}.json"))
        assert code == 0, stderr[-2000:]
        runs[name] = read_record(tmp_path / f"{name}.json")["results"]
    recompute = runs["auto"]["recompute"]
    loop = recompute["closed_loop"]
    assert loop["first"]["plan"].count("none") < len(loop["first"]["plan"])  # the stale forecast recomputed
    assert loop["replanned"] and 0.1 <= loop["activation_scale"] < 1
    assert loop["first_measured_peak_bytes"] < 0.85 * loop["first"]["forecast_peak_bytes"]
    assert recompute["plan"] == loop["second"]["plan"] == ["none"] * len(recompute["plan"])
    assert recompute["fits"] and runs["auto"]["peak_allocated_bytes"] <= budget  # the new plan's measured peak
    assert runs["auto"]["peak_allocated_bytes"] == runs["plain"]["peak_allocated_bytes"]
    assert runs["auto"]["losses"] == runs["plain"]["losses"]
    assert "closed loop: measured" in stdout["auto"]


def test_the_plan_line_gives_each_size_a_unit_that_suits_it():
    """``forecast 21.3 of 0.0 MiB`` (a 1 KiB budget) and ``0.0 of 22.4 GiB`` said nothing."""

    def line(forecast: float, budget: int) -> str:
        return Decision(plan=("full",), budget_bytes=budget, forecast_bytes=forecast, fits=True).line()

    assert line(71.2 * 1024**3, 72 * 1024**3).endswith("forecast 71.2 of 72.0 GiB")
    assert line(5 * 1024**2, 200 * 1024**2).endswith("forecast 5.0 of 200.0 MiB")
    assert line(int(21.3 * 1024**2), 1024).endswith("forecast 21.30 MiB of 1.00 KiB")
    assert line(20 * 1024, int(22.4 * 1024**3)).endswith("forecast 20.00 KiB of 22.40 GiB")
