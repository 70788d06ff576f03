"""What a new user tripped over (issue 37, items 1, 2, 5, 10 and 12), each checked by a test that failed before
its fix: in-process runs of ``torch/llama-tiny`` (the forecast traces it once, then answers in milliseconds).

Run: ``.venv/bin/python -m pytest -q tests/test_newcomer_fixes.py``.
"""

from __future__ import annotations

import io
import json
import sys

import pytest

from ljperf import cli
from ljperf.ablation import report
from ljperf.ablation.stats import summarize
from ljperf.ablation.variants import parse_variants
from ljperf.benchmark.compile_report import length_row, print_report
from ljperf.benchmark.memory_check import shortfall
from ljperf.commands.ablation import check_variant, split_argv, warn_untested_recompute
from ljperf.core.errors import EXIT_DOES_NOT_FIT
from ljperf.core.options import EngineConfig, TrainConfig
from ljperf.core.plans import no_recompute_line
from ljperf.core.spread import OVERLAP_NOTE
from ljperf.core.units import format_bytes
from ljperf.forecast.advice import dominant_term
from ljperf.forecast.api import forecast
from ljperf.forecast.recipe import Recipe, ZeroSettings
from ljperf.models.spec import resolve
from ljperf.recompute.cost import Rates
from ljperf.recompute.run import untested_auto
from ljperf.recompute.solver import solve_recipe
from ljperf.run.config import RunConfig
from ljperf.run.context import unjoined

TINY = ["--model", "torch/llama-tiny", "--precision", "fp32", "--seq-len", "64"]
"""Traced once at micro batch 1 (none and full recompute), as other tests trace it: plans here that do not fit
need no other trace (the largest micro batch search stops at 1)."""
NO_BUDGET = ["--recompute", "auto", "--memory-budget", "1MiB"]


def plan(capsys, *argv: str) -> tuple[int, dict, str]:
    """``ljperf plan ARGV --json`` in this process: (exit code, the record, stderr)."""
    code = cli.main(["plan", *argv, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


# --- item 5: ljperf plan ------------------------------------------------------------------------------------------


def test_a_plan_that_does_not_fit_exits_4(capsys):
    """It exited 0 beside "does NOT fit": a script could not tell without parsing the table (a plan that fits
    exits 0: ``test_checkpoint_plan``)."""
    code, out, _ = plan(capsys, *TINY, "--device", "cpu", "--gpu-memory", "1MiB")
    assert (code, out["fits"]) == (EXIT_DOES_NOT_FIT, False)
    assert cli.main(["plan", *TINY, "--device", "cpu", "--gpu-memory", "1MiB"]) == EXIT_DOES_NOT_FIT  # the table
    assert "does NOT fit in 1.00 MiB" in capsys.readouterr().out
    # --recompute auto with no plan under its budget: the same code, and one line of what would (it was exit 2)
    code, out, err = plan(capsys, "--model", "fsdp/llama-tiny", "--gpus", "2", "--device", "cpu", *TINY[2:], *NO_BUDGET)
    assert (code, out["fits"], out["recompute"]["fits"]) == (EXIT_DOES_NOT_FIT, False, False)
    assert err.count("\n") == 1 and "full recompute does not fit with 8 processes either" in err  # not GPUs
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    assert "exit codes: 0 it fits; 4 it does NOT fit" in " ".join(capsys.readouterr().out.split())


def test_plan_names_the_gpu_only_when_it_was_not_given(capsys):
    """``--gpu H100`` was told to "name it with --gpu"; ``--gpu-memory 80GiB`` read as "H100 datasheet (give --gpu
    NAME ...)"; the command's description ended in "; --calibrate"."""
    _, named, _ = plan(capsys, *TINY, "--gpu", "H100", *NO_BUDGET)
    _, unnamed, _ = plan(capsys, *TINY, "--gpu-memory", "80GiB", *NO_BUDGET)
    assert not any("--gpu" in n for n in named["notes"]), named["notes"]
    assert any("no calibration for H100 is saved here" in n for n in named["notes"]), named["notes"]
    assert any("name it with --gpu" in n for n in unnamed["notes"]), unnamed["notes"]
    assert named["recompute"]["rates"] == "H100 datasheet"
    rates = unnamed["recompute"]["rates"]
    assert "give --gpu NAME" not in rates and "the given 80.00 GiB (--gpu-memory), uncalibrated overheads" in rates
    assert not cli.COMMANDS["plan"].help.endswith("--calibrate") and "(--calibrate)" in cli.COMMANDS["plan"].help


# --- item 2: ljperf compile-report ----------------------------------------------------------------------------------


def test_compile_report_shows_each_cells_spread_and_marks_overlapping_ranges(capsys):
    """One number per cell read as a 12.37× speed-up at 512 tokens while eager time fell as the sequence grew
    (8.1 s at 512, 3.1 s at 2048): a slow first round, noise. Three rounds of each (seconds per step)."""
    noisy = length_row(512, [8.1, 0.62, 0.70], [0.65, 0.66, 0.70], compile_s=20.0, recompiles=[])
    clear = length_row(2048, [3.1, 3.0, 3.2], [1.5, 1.4, 1.6], compile_s=1.5, recompiles=["a guard"])
    assert noisy["eager_step_s_repeats"] == [8.1, 0.62, 0.70] and noisy["compiled_step_s_repeats"][0] == 0.65
    assert (noisy["eager_step_s"], noisy["speedup"], noisy["overlap"]) == (0.70, pytest.approx(0.70 / 0.66), True)
    assert (clear["eager_step_s"], clear["speedup"], clear["overlap"]) == (3.1, pytest.approx(3.1 / 1.5), False)
    config = {"model": "llama-tiny", "compile_mode": "regional", "precision": "fp32", "repeats": 3}
    compiled = {"time_s_per_region": {"model.layers.0": 21.5}, "time_s": 21.5, "fallbacks": []}
    breaks = {"count": 0, "graphs": 1, "reasons": []}
    print_report({"config": config, "lengths": [noisy, clear], "compile": compiled, "graph_breaks": breaks})
    out = capsys.readouterr().out
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines())
            if cells and cells[0].isdigit()}  # fmt: skip
    assert rows["512"][:6] == ["512", "700.0", "620.0–8100.0", "660.0", "650.0–700.0", "×1.06 ≈"]
    assert rows["2048"][:6] == ["2048", "3100.0", "3000.0–3200.0", "1500.0", "1400.0–1600.0", "×2.07"]
    assert OVERLAP_NOTE in out and "3 repeat(s)" in out


# --- item 10: the ablation chart -----------------------------------------------------------------------------------


def ablation_run(variant: str, index: int, repeat: int, tokens_per_s: float) -> dict:
    """A finished run's record, as much of it as the report reads."""
    config = {
        "engine": {"name": "fsdp"},
        "model": {"name": "llama-tiny"},
        "launch": {"world_size": 2},
        "train": {"micro_batch": 4, "seq_len": 256, "grad_accum": 1, "precision": "fp32", "steps": 5, "warmup": 1},
    }
    env = {"name": "local", "python": "python", "prefix": "/", "versions": {}}
    meta = {"variant": variant, "variant_index": index, "flags": "", "repeat": repeat, "environment": env}
    meta |= {"environment_index": 0, "command": [], "wall_s": 9.0, "log": f"{variant}.r{repeat}.log"}
    results = {"status": "ok", "tokens_per_s": tokens_per_s, "peak_allocated_bytes": 2**30, "losses": [1.0]}
    return {"ablation": meta, "config": config, "env": {"devices": ["cpu"]}, "results": results}


def test_the_ablation_chart_is_titled_and_its_bars_are_the_tables_median_run(tmp_path):
    """The chart had no title; then its bar was the mean of 2 repeats while the table showed the slower run (and
    the chart printed the table's ratio above the mean's bar). One statistic for both: the median run (of an even
    count, the slower middle one), named on the chart."""
    from PIL import Image

    two = [ablation_run("base", 0, 1, 20480.0), ablation_run("base", 0, 2, 4096.0)]
    three = [ablation_run("compile", 1, k, tps) for k, tps in enumerate([100.0, 90.0, 250.0], start=1)]
    base, compiled = summarize(two + three)
    assert (report.bar_height(base.tokens_per_s), report.bar_height(compiled.tokens_per_s)) == (4096.0, 100.0)
    header, body = report.rows([base, compiled])
    assert [row[header.index("tokens/s")] for row in body] == ["4,096", "100"]
    assert compiled.speedup.value == pytest.approx(100.0 / 4096.0)
    report.chart(two + three, [base, compiled], tmp_path / "chart.png")
    meta = Image.open(tmp_path / "chart.png").text
    assert meta["Title"].startswith("fsdp/llama-tiny · 2 process(es) · mb 4 × seq 256 × accum 1 · fp32 · ")
    assert meta["Title"].endswith(" · device: cpu")
    assert meta["Description"] == "throughput bar: the median run (of an even count, the slower middle one)"


# --- item 1: --recompute auto that recomputes nothing ----------------------------------------------------------------

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


# --- item 12: advice that names the term that dominates the peak ---------------------------------------------------

DEFAULT_BUCKET = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 500_000_000}}
"""DeepSpeed's own default bucket, as a script that leaves it gets it: 1.87 GiB of a tiny Llama's 1.88 GiB peak."""


def test_a_dominant_bucket_is_named_with_its_setting_in_plan_the_hook_and_the_memory_check(tmp_path, capsys):
    """The advice was "full recompute does not fit with micro batch 1, ZeRO stage 3 or 8 processes either"."""
    spec = resolve(name="llama-tiny")
    train = TrainConfig(device="cpu", precision="fp32", micro_batch=1, seq_len=64)
    cfg = RunConfig(engine="deepspeed", model=spec, train=train, engine_opts=EngineConfig(zero_stage=2))
    cfg.deepspeed_user = DEFAULT_BUCKET
    recipe = Recipe.of(cfg, world=2, device="cpu")
    result = forecast(spec, recipe)
    bucket, peak = result.breakdown["comm_buffers"], result.peak_allocated_bytes
    assert bucket >= 500_000_000 * 4 > 0.4 * peak  # the rule: the largest named term is at least 40% of the peak
    auto = forecast(spec, recipe.with_(zero=ZeroSettings(reduce_bucket_size=spec.hidden**2))).device_bytes
    line = (
        f"DeepSpeed's gradient bucket (zero_optimization.reduce_bucket_size 500,000,000 elements) is"
        f" {format_bytes(bucket)} of the {format_bytes(peak)} peak ({bucket / peak:.0%}): lower reduce_bucket_size in"
        f' --deepspeed-config (hidden², {spec.hidden**2:,} elements, ljperf\'s "auto": forecast {format_bytes(auto)})'
    )
    assert dominant_term(spec, recipe, result) == line
    # ljperf plan: a note under the table
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEFAULT_BUCKET))
    argv = ["--model", "deepspeed/llama-tiny", "--gpus", "2", "--device", "cpu", "--precision", "fp32"]
    code, out, _ = plan(capsys, *argv, "--seq-len", "64", "--gpu-memory", "500MiB", "--deepspeed-config", str(path))
    assert code == EXIT_DOES_NOT_FIT and line in out["notes"]
    full_note = next(note for note in out["notes"] if note.startswith("with --recompute full"))
    assert out["notes"].index(line) < out["notes"].index(full_note)  # read first: what else fits is in its light
    # the startup hook's planning line: the solver's advice, in words, first
    budget = 500 * 2**20
    decision = solve_recipe(spec, recipe, budget=budget, rates=Rates.datasheet("H100"), flags=False)
    assert decision.fits is False and decision.advice[1].startswith("DeepSpeed's gradient bucket (zero_optimization")
    assert decision.advice[0].startswith("activations are under 2% of the peak")  # 0: checkpointing cannot help
    assert "lower reduce_bucket_size in the DeepSpeed config (hidden²" in decision.line()
    # the benchmark's memory check before a run starts
    short = shortfall(unjoined(cfg, world=2), None, memory=2**30, processes=1, device_name="cpu")
    assert short is not None and short[1].startswith(f"{line};")
    # a term under 40% (ljperf's own bucket) has no such line
    small = recipe.with_(zero=ZeroSettings())
    assert dominant_term(spec, small, forecast(spec, small)) is None
    # ZeRO-3 on 8 ranks: the gathered parameters (DeepSpeed's default prefetch) are 63% of the peak
    zero3 = small.with_(zero_stage=3, world=8)
    at_zero3 = forecast(spec, zero3)
    gathered = at_zero3.breakdown["gathered_parameters"]
    assert gathered > 0.6 * at_zero3.peak_allocated_bytes > at_zero3.breakdown["activations"]
    assert dominant_term(spec, zero3, at_zero3).startswith(
        f"ZeRO-3's gathered parameters (stage3_prefetch_bucket_size 50,000,000, stage3_max_live_parameters"
        f" 1,000,000,000 elements) is {format_bytes(gathered)} of the"
    )
