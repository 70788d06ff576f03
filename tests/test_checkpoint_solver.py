"""``--recompute auto``: the solver's plan fits the budget in a real run; an impossible budget exits 2; auto that
recomputes nothing says so, in the run and in an ablation's table."""

from __future__ import annotations

import io
import json
import sys

import pytest

from ljperf import cli
from ljperf.ablation import report
from ljperf.ablation.variants import parse_variants
from ljperf.commands.ablation import check_variant, split_argv, warn_untested_recompute
from ljperf.core.plans import no_recompute_line
from ljperf.core.units import format_bytes
from ljperf.forecast import Recipe, forecast
from ljperf.models.spec import resolve
from ljperf.recompute.run import untested_auto
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


# --- --recompute auto that recomputes nothing ----------------------------------------------------------------------

RUN = ["--model", "torch/llama-tiny", "--device", "cpu", "--micro-batch", "4", "--seq-len", "512", "--steps", "1"]
"""Forecast 146 MiB without recompute, 70 MiB with full recompute: the RAM (the CPU's budget) holds it whole."""


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory) -> tuple[dict, str]:
    """(the record, the standard output) of a benchmark with ``--recompute auto`` and no budget, in this process."""
    out = tmp_path_factory.mktemp("auto") / "run.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LJPERF_MEMORY_BUDGET", raising=False)
        mp.setattr("sys.stdout", io.StringIO())
        code = cli.main(["benchmark", *RUN, "--warmup", "1", "--recompute", "auto", "--output", str(out)])
        printed = sys.stdout.getvalue()
    assert code == 0, printed
    return json.loads(out.read_text()), printed


def test_auto_that_recomputes_nothing_says_so_at_the_top_of_the_run(auto_run):
    """``compile+ckpt`` on CPU with no budget was ``compile`` with nothing said: ``recompute 0/4 layers``."""
    record, printed = auto_run
    plan = record["results"]["recompute"]
    none, full = plan["forecast_none_bytes"], plan["forecast_full_bytes"]
    assert plan["plan"] == ["none"] * 4 and plan["forecast_peak_bytes"] == none and full < none
    expected = no_recompute_line(plan)
    assert expected == (
        f"recompute auto chose no recompute: the budget {format_bytes(plan['budget_bytes'])} holds the whole run"
        f" (forecast {format_bytes(none)}); set --memory-budget or LJPERF_MEMORY_BUDGET to test it, e.g."
        f" --memory-budget {round((none + full) / 2 / 2**20)}MiB (between the forecasts with full recompute,"
        f" {format_bytes(full)}, and none, {format_bytes(none)})"
    )
    assert printed.splitlines()[1] == expected  # under "recomputing 0/4 layers ..."


def test_ablation_marks_the_variant_and_suggests_a_budget_before_its_runs(auto_run, tmp_path, capsys):
    record, _ = auto_run
    [variant] = parse_variants("compile+ckpt", [])
    cfg = check_variant(split_argv(["ablation", *RUN], "ablation"), variant)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LJPERF_MEMORY_BUDGET", raising=False)
        warn_untested_recompute([variant], [cfg])  # what ljperf ablation prints before its runs
        mp.setenv("LJPERF_MEMORY_BUDGET", "100MiB")
        assert untested_auto(cfg) is None  # a budget is given: it tests something
    plan = record["results"]["recompute"]
    before = capsys.readouterr().out
    assert before.startswith("variant compile+ckpt: recompute auto will choose no recompute: the budget ")
    assert before.endswith(no_recompute_line(plan).split("holds the whole run")[1] + "\n")  # the same forecasts
    # The table marks the variant and says why under it, in report.md too.
    env = {"name": "local", "python": "python", "prefix": "/", "versions": {}}
    meta = {"variant": "compile+ckpt", "variant_index": 0, "flags": "--compile --recompute auto", "repeat": 1}
    meta |= {"environment": env, "environment_index": 0, "command": RUN, "wall_s": 5.0, "log": "x.log"}
    report.render(tmp_path, [{**record, "ablation": meta}], command=None)
    printed, md = capsys.readouterr().out, (tmp_path / "report.md").read_text()
    line = f"† compile+ckpt: {no_recompute_line(plan)}"
    assert "compile+ckpt †" in printed and line in printed
    assert "| compile+ckpt † | --compile --recompute auto | ok |" in md and f"† `compile+ckpt`: {line[16:]}" in md
