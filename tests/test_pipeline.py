"""Pipeline parallel (``--pp``) as ``ljperf plan`` forecasts it, and the bad inputs refused before any process starts.

Run: ``.venv/bin/python -m pytest tests/test_pipeline.py``. The runs themselves (``--pp 2`` on 2 processes, with
FSDP2 or ``--tp 2`` on 4) train in tests/test_mesh.py's launches.
"""

from __future__ import annotations

import json

import pytest

from ljperf.cli import main
from ljperf.forecast import Recipe
from ljperf.forecast.api import analytic_forecast
from ljperf.forecast.pipeline import bubble_fraction, in_flight
from ljperf.models.pipeline_split import balanced_split
from ljperf.models.spec import resolve

TINY = ["plan", "--model", "fsdp/llama-tiny", "--device", "cpu", "--seq-len", "32"]

BAD = [
    (["--gpus", "6", "--pp", "4"], "--pp 4 does not divide the world size 6"),
    (["--gpus", "8", "--pp", "2", "--tp", "2", "--dp-replicate", "3"], "--pp 2 × --dp-replicate 3 × --tp 2 = 12"),
    (["--gpus", "2", "--pp", "2", "--pp-split", "4,0"], "give 2 counts of one or more (one per stage)"),
    (["--gpus", "2", "--pp", "2", "--pp-split", "2-2"], "write the layers of each stage, e.g. 10,12,10"),
    (["--gpus", "8", "--pp", "8"], "8 stages for llama-tiny's 4 layers: a stage would be empty"),
    (
        ["--gpus", "2", "--pp", "2", "--pp-microbatches", "1"],
        "give --pp-microbatches 2 or more, or --pp-schedule gpipe",
    ),
    (["--gpus", "2", "--pp-microbatches", "2"], "--pp-microbatches is an option of --pp N"),
    (["--gpus", "2", "--pp", "2", "--pp-schedule", "interleaved-1f1b"], "--pp-stages-per-rank 2 or more"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_pipeline_exits_2_with_one_line(argv, message, capsys):
    assert main([*TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "deepspeed/llama-tiny"], "--pp builds a device mesh for the fsdp engine"),
        (["--model", "torch/llama-tiny"], "--pp builds a device mesh for the fsdp engine"),
        (["--model", "fsdp/mixtral-tiny"], "model_type 'mixtral' is not one: run it without --pp"),
        (["--model", "fsdp/llama-tiny", "--compile-mode", "whole"], "--compile-mode whole runs the whole model's"),
    ],
)
def test_pipelining_another_engine_or_an_unknown_decoder_exits_2(argv, message, capsys):
    assert main(["benchmark", *argv, "--pp", "2", "--nproc-per-node", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_tied_embeddings_cannot_be_split(tmp_path, capsys):
    from ljperf.models.catalog import read_config_dict

    config = tmp_path / "tied.json"
    config.write_text(json.dumps({**read_config_dict(name="llama-tiny"), "tie_word_embeddings": True}))
    assert main(["plan", "--model-config", str(config), "--engine", "fsdp", "--gpus", "2", "--pp", "2"]) == 2
    assert "ties them (tie_word_embeddings): run it without --pp" in capsys.readouterr().err


def test_the_bubble_is_p_minus_1_over_v_m_plus_p_minus_1():
    assert bubble_fraction(pp=4, microbatches=4) == pytest.approx(3 / 7)
    assert bubble_fraction(pp=4, microbatches=12) == pytest.approx(3 / 15)
    assert bubble_fraction(pp=4, microbatches=8, stages_per_rank=2) == pytest.approx(3 / 19)
    assert bubble_fraction(pp=1, microbatches=8) == 0


def test_1f1b_holds_up_to_pp_micro_batches_gpipe_all():
    assert [in_flight(schedule="1f1b", stage=s, pp=4, microbatches=8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(schedule="1f1b", stage=s, pp=4, microbatches=2) for s in range(4)] == [2, 2, 2, 1]
    assert {in_flight(schedule="gpipe", stage=s, pp=4, microbatches=8) for s in range(4)} == {8}


def test_the_split_balances_the_costs_with_every_stage_non_empty():
    assert balanced_split([1.0] * 8, stages=4) == [2, 2, 2, 2]
    # a heavy last stage (the LM head) gets fewer layers
    assert balanced_split([1.0] * 8, stages=2, ends=(0.0, 2.0)) == [5, 3]
    assert min(balanced_split([1.0, 100.0, 1.0, 1.0], stages=4)) == 1


def _plan(capsys, *argv: str) -> dict:
    assert main([*TINY, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_gives_each_pipeline_ranks_peak_and_the_bubble(capsys):
    report = _plan(capsys, "--gpus", "4", "--pp", "2", "--pp-microbatches", "4", "--micro-batch", "2")
    pipeline = report["pipeline"]
    assert report["recipe"]["mesh"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert sum(pipeline["split"]) == 4 and len(pipeline["split"]) == 2
    peaks = pipeline["peak_allocated_bytes_per_pp_rank"]
    assert len(peaks) == 2 and max(peaks) == report["peak_allocated_bytes"]
    assert report["phase"].startswith(f"pipeline rank {peaks.index(max(peaks))}, ")
    assert pipeline["bubble_fraction"] == pytest.approx(1 / 5)
    assert report["speed"]["breakdown"]["bubble"] > 0 and report["speed"]["breakdown"]["pp_send"] > 0


def test_gpipe_holds_every_micro_batch_so_its_first_stage_peaks_higher(capsys):
    """The first stage holds min(M, pp) micro-batches' activations under 1F1B and all M under GPipe."""
    common = ("--gpus", "2", "--pp", "2", "--pp-microbatches", "8", "--micro-batch", "2", "--pp-split", "2,2")
    one_f_one_b = _plan(capsys, *common)["pipeline"]["peak_allocated_bytes_per_pp_rank"]
    gpipe = _plan(capsys, *common, "--pp-schedule", "gpipe")["pipeline"]["peak_allocated_bytes_per_pp_rank"]
    assert gpipe[0] > one_f_one_b[0]
    four = _plan(capsys, *common[:5], "4", *common[6:])["pipeline"]["peak_allocated_bytes_per_pp_rank"]
    # 1F1B: more micro-batches than stages add none in flight, only their token ids (a few KiB) and the first
    # stage's receive buffers for their gradients (one micro-batch's hidden states each: 2 × 32 × 128 fp32)
    assert four[0] + 4 * 2 * 32 * 128 * 4 == pytest.approx(one_f_one_b[0], abs=8 * 2 * 32 * 8)


def test_1f1b_walks_its_steady_state_once_and_more_micro_batches_add_only_buffers_and_token_ids(capsys):
    """From 4 to 33 micro-batches, 1F1B's steady state (walked twice and repeated, ``walk._walk_steady``) keeps
    as many in flight: each stage's peak rises by 29 receive buffers (a micro-batch's hidden states each) and
    the token ids alone, not by activations."""
    common = ("--gpus", "4", "--pp", "2", "--micro-batch", "2", "--pp-microbatches")
    four = _plan(capsys, *common, "4")["pipeline"]["peak_allocated_bytes_per_pp_rank"]
    many = _plan(capsys, *common, "33")["pipeline"]["peak_allocated_bytes_per_pp_rank"]
    buffers, token_ids = 29 * 2 * 32 * 128 * 4, 29 * 2 * 32 * 16
    assert all(0 < m - f - buffers < token_ids for f, m in zip(four, many, strict=True)), (four, many)


def test_the_plan_table_names_each_pipeline_rank(capsys):
    assert main([*TINY, "--gpus", "2", "--pp", "2", "--pp-split", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 1f1b, 2 micro-batches a step" in out
    assert "│             0 │      0 │ 0-0 " in out and "│             1 │      1 │ 1-3 " in out
    assert "pipeline bubble: 33.3% of the step" in out


def test_more_micro_batches_shrink_the_predicted_bubble(capsys):
    shares = []
    for m in ("2", "8"):
        speed = _plan(capsys, "--gpus", "2", "--pp", "2", "--pp-microbatches", m, "--micro-batch", "1")["speed"]
        shares.append(speed["breakdown"]["bubble"] / speed["step_time_s"])
    assert shares[1] < shares[0]


@pytest.mark.slow
def test_405b_on_512_gpus_with_pp_8_and_tp_8_is_planned(capsys):
    argv = ["plan", "--model", "fsdp/llama3.1-405b", "--gpus", "512", "--gpu", "H100", "--pp", "8", "--tp", "8"]
    assert main([*argv, "--seq-len", "8192", "--pp-microbatches", "16", "--recompute", "full", "--json"]) in (0, 4)
    report = json.loads(capsys.readouterr().out)
    assert report["recipe"]["mesh"] == {"pp": 8, "dp_replicate": 1, "dp_shard": 8, "tp": 8}
    assert len(report["pipeline"]["peak_allocated_bytes_per_pp_rank"]) == 8 and sum(report["pipeline"]["split"]) == 126
    assert report["max_micro_batch"] >= 1 and report["speed"]["breakdown"]["bubble"] > 0


def test_the_analytic_fallback_of_a_pipeline_stage_sizes_the_stages_own_layers():
    """A stage whose trace fails falls back to the formula over its own blocks (it indexed the whole model's
    layers in the stage's: an IndexError, a traceback from ``plan --search``)."""
    spec = resolve(name="llama-tiny")
    recipe = Recipe(
        engine="fsdp", world=2, device="cpu", micro_batch=2, seq_len=32, pp=2, grad_accum=2, pp_split=(2, 2), stage=1
    )
    assert analytic_forecast(spec, recipe, reason="a test").peak_allocated_bytes > 0
