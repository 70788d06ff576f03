"""``--optimizer-impl``: the AdamW implementation a run uses, its record, and the forecast that follows it.

Run: ``.venv/bin/python -m pytest -q tests/test_optimizer_impl.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from ljperf.core.options import TrainConfig, default_adamw_impl
from ljperf.engines.common import adamw
from ljperf.forecast import Recipe, forecast
from ljperf.models.spec import resolve
from ljperf.run.config import RunConfig
from ljperf.run.context import unjoined

from conftest import run_main

TINY = ["benchmark", "--model", "torch/llama-tiny", "--seq-len", "32", "--steps", "1", "--warmup", "1"]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """One state-bound run per implementation (the optimizer step sets the peak), in this process."""
    out = tmp_path_factory.mktemp("impl")
    found = {}
    for impl in (None, "single", "foreach", "fused"):
        path = out / f"{impl}.json"
        args = [*TINY, "--threads", "1", "--output", str(path)] + (["--optimizer-impl", impl] if impl else [])
        code, _, err = run_main(None, *args)
        assert code == 0, err
        found[impl] = json.loads(path.read_text())
    return found


def test_each_implementation_is_recorded_and_forecast_to_the_byte(records):
    """The forecast counts each implementation's temporaries in the optimizer step (foreach's lists of
    intermediates set the peak there; the single loop's and the fused kernel's stay under the backward's): it
    matches the measured peak of each."""
    peaks = {}
    for impl, record in records.items():
        res = record["results"]
        assert record["config"]["optimizations"]["optimizer_impl"] == (impl or "single")  # torch's pick on a CPU
        assert abs(res["forecast"]["error_pct"]) < 0.5, (impl, res["forecast"])
        peaks[impl] = res["peak_allocated_bytes"]
    assert records["foreach"]["results"]["forecast"]["phase"].startswith("optimizer step")
    assert peaks[None] == peaks["single"] and peaks["foreach"] > peaks["fused"], peaks


def test_plan_takes_the_same_flag_and_its_old_spelling(capsys):
    args = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "32", "--json"]
    code, out, _ = run_main(capsys, *args, "--optimizer-impl", "fused")
    assert code == 0 and json.loads(out)["recipe"]["optimizer"] == "fused"
    code, out, err = run_main(capsys, *args, "--optimizer", "foreach")
    assert code == 0 and json.loads(out)["recipe"]["optimizer"] == "foreach"
    assert "--optimizer is deprecated here: write --optimizer-impl" in err


def test_a_cuda_run_defaults_to_fused_adamw(capsys):
    """On CUDA the engines run fused AdamW unless told otherwise (as torchtitan does), and the forecast of a CUDA
    plan counts fused's temporaries: the same peak as ``--optimizer-impl fused``, below foreach's."""
    assert (default_adamw_impl("cuda"), default_adamw_impl("cpu")) == ("fused", "single")
    spec = resolve(name="llama-tiny")
    peaks = {
        impl: forecast(spec, Recipe(device="cuda", micro_batch=1, seq_len=32, optimizer=impl)).peak_allocated_bytes
        for impl in (None, "fused", "foreach")
    }
    assert peaks[None] == peaks["fused"] < peaks["foreach"], peaks
    run = unjoined(RunConfig(engine="torch", model=spec, train=TrainConfig(device="cpu")), world=1)
    assert adamw([torch.zeros(2, requires_grad=True)], run=run).defaults["foreach"] is False  # a CPU run: single
