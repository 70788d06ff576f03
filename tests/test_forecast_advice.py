"""The forecast's advice (``forecast.advice``): a term that dominates the peak is named with the setting that
sizes it, in ``ljperf plan``'s notes, the startup hook's planning line and the benchmark's memory check.

Run: ``.venv/bin/python -m pytest -q -n 0 tests/test_forecast_advice.py``.
"""

from __future__ import annotations

import json

from ljperf import cli
from ljperf.benchmark.memory_check import shortfall
from ljperf.core.errors import EXIT_DOES_NOT_FIT
from ljperf.core.options import EngineConfig, TrainConfig
from ljperf.core.units import format_bytes
from ljperf.forecast.advice import dominant_term
from ljperf.forecast.api import forecast
from ljperf.forecast.recipe import Recipe, ZeroSettings
from ljperf.models.spec import resolve
from ljperf.recompute.cost import Rates
from ljperf.recompute.solver import solve_recipe
from ljperf.run.config import RunConfig
from ljperf.run.context import unjoined

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
    argv = ["plan", "--model", "deepspeed/llama-tiny", "--gpus", "2", "--device", "cpu", "--precision", "fp32"]
    code = cli.main([*argv, "--seq-len", "64", "--gpu-memory", "500MiB", "--deepspeed-config", str(path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == EXIT_DOES_NOT_FIT and line in out["notes"]
    full_note = next(note for note in out["notes"] if note.startswith("with --recompute full"))
    assert out["notes"].index(line) < out["notes"].index(full_note)  # read first: what else fits is in its light
    # the startup hook's planning line: the solver's advice, in words, first
    budget = 500 * 2**20
    rates = Rates.datasheet("H100")
    assert rates is not None
    decision = solve_recipe(spec, recipe, budget=budget, rates=rates, flags=False)
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
    zero3_line = dominant_term(spec, zero3, at_zero3)
    assert zero3_line is not None and zero3_line.startswith(
        f"ZeRO-3's gathered parameters (stage3_prefetch_bucket_size 50,000,000, stage3_max_live_parameters"
        f" 1,000,000,000 elements) is {format_bytes(gathered)} of the"
    )
