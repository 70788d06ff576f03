"""``--loss chunked``: the same loss and gradients as HF's plain loss, a lower measured peak, and a forecast that
follows it."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from ljperf.forecast import Recipe, forecast
from ljperf.models.build import materialize
from ljperf.models.catalog import read_config_dict
from ljperf.models.loss import chunk_sizes, use_chunked_loss
from ljperf.models.spec import build_meta, resolve
from ljperf.models.step import causal_lm_loss
from test_forecast import measured_peak

from conftest import FORECAST_TOLERANCE, read_record, run_main

LARGE_VOCAB = {**read_config_dict(name="llama-tiny"), "vocab_size": 32768}
"""llama-tiny with a 32k vocabulary, whose logits are most of a step's peak (test_forecast_engines traces its plain
step at micro batch 1 too: the suite traces it once)."""


GEMMA2 = {
    "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1024, "max_position_embeddings": 256,
}  # fmt: skip
"""A tiny Gemma 2: tied embeddings and final_logit_softcapping (30 by default)."""


@pytest.mark.parametrize("name", ["llama-tiny", "qwen-tiny", "gemma2"])  # untied, tied, tied and soft-capped
def test_chunked_loss_and_gradients_equal_the_plain_ones(name, tmp_path):
    """fp32, two sequences of 100 tokens (200 tokens: 16 chunks of 12 and 13) with an ignored label. Measured:
    loss within 1e-6, every gradient within 3e-8 of the plain loss's."""
    if name == "gemma2":
        (tmp_path / "config.json").write_text(json.dumps(GEMMA2))
        spec = resolve(path=tmp_path / "config.json")
    else:
        spec = resolve(name=name)
    plain = materialize(build_meta(spec, attn_implementation="eager"), device=torch.device("cpu"), seed=0)
    chunked = copy.deepcopy(plain)
    use_chunked_loss(chunked)
    tokens = torch.randint(0, spec.vocab, (2, 100), generator=torch.Generator().manual_seed(0))
    labels = tokens.clone()
    labels[1, 40] = -100  # HF's ignore_index: that position's prediction is not counted
    expected = plain(input_ids=tokens, labels=labels, use_cache=False).loss
    got = chunked(input_ids=tokens, labels=labels, use_cache=False).loss
    expected.backward()
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert (chunked.lm_head.weight is chunked.model.embed_tokens.weight) == spec.config.tie_word_embeddings
    for (key, want), have in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(have.grad, want.grad, rtol=1e-5, atol=1e-6, msg=key)
    assert causal_lm_loss(chunked, tokens).item() == pytest.approx(causal_lm_loss(plain, tokens).item(), rel=1e-6)


def test_chunk_sizes():
    assert chunk_sizes(200) == [13] * 8 + [12] * 8
    assert chunk_sizes(3) == [1, 1, 1]
    assert sum(chunk_sizes(16384)) == 16384 and set(chunk_sizes(16384)) == {1024}


def test_bad_loss_exits_2_with_one_line(capsys):
    for args, expected in (
        (["--loss", "bogus"], "--loss 'bogus': choose one of plain, chunked"),
        (["--loss", "chunked", "--tp", "2", "--nproc-per-node", "2"], "--loss chunked runs the LM head whole"),
    ):
        code, _, err = run_main(capsys, "benchmark", "--model", "fsdp/llama-tiny", *args)
        assert code == 2 and err.strip().splitlines() == [err.strip()] and expected in err, err


@pytest.mark.slow
def test_chunked_loss_lowers_the_measured_and_forecast_peak(tmp_path):
    """A benchmark run of the chunked loss on a 32k vocabulary at 1 × 512 tokens records its loss and a forecast
    within test_forecast's 5% of its measured peak; a plain step's is measured as that run measures it. Measured:
    332.8 MB plain, 182.1 MB chunked; both forecasts exact (to 4 bytes)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LARGE_VOCAB))
    out = tmp_path / "chunked.json"
    code, _, err = run_main(
        None, "benchmark", "--model-config", str(config), "--seq-len", "512", "--steps", "1", "--warmup", "1",
        "--device", "cpu", "--loss", "chunked", "--output", str(out),
    )  # fmt: skip
    assert code == 0, err
    record = read_record(out)
    assert record["config"]["optimizations"]["loss"] == "chunked"
    chunked = record["results"]["peak_allocated_bytes"]
    predicted = record["results"]["forecast"]
    assert predicted["source"] == "traced" and abs(predicted["error_pct"]) < 100 * FORECAST_TOLERANCE, predicted
    spec = resolve(path=config)
    plain = measured_peak(spec, micro_batch=1, seq_len=512, recompute="none")
    assert chunked < 0.7 * plain, (chunked, plain)
    plain_forecast = forecast(spec, Recipe(device="cpu", precision="fp32", micro_batch=1, seq_len=512))
    assert abs(plain_forecast.peak_allocated_bytes - plain) / plain < FORECAST_TOLERANCE, (plain_forecast, plain)
    assert predicted["peak_allocated_bytes"] < 0.7 * plain_forecast.peak_allocated_bytes
