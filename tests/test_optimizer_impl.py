"""``--optimizer-impl``: the AdamW implementation a run uses, its record, and the forecast that follows it.

Run: ``.venv/bin/python -m pytest -q tests/test_optimizer_impl.py``.
"""

from __future__ import annotations

import json

import pytest

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
