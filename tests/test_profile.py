"""``ljperf benchmark --profile DIR`` and the step time breakdown (``results.breakdown``): the trace a CPU run
writes loads and holds the step's phases, the parts add up to the measured step, a bad folder is refused first.

Run: ``.venv/bin/python -m pytest -q tests/test_profile.py`` (one profiled and one timed run of llama-tiny in this
process, a few seconds; ``-m slow`` adds FSDP2 on 2 processes).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import statistics
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import torch

from ljperf import cli
from ljperf.benchmark.breakdown import from_trace
from ljperf.benchmark.profile import trace_path

from conftest import read_record, run_ljperf

TINY = ["--model", "torch/llama-tiny", "--seq-len", "32", "--warmup", "1", "--steps", "3", "--device", "cpu"]
PHASES = ("forward", "backward", "optimizer")


def schema() -> dict:
    return json.loads((Path(__file__).parents[1] / "src/ljperf/schemas/benchmark-result.schema.json").read_text())


def benchmark(*argv: str) -> tuple[int, str]:
    """``ljperf benchmark ARGV`` in this process, on one thread (two would fight the other tests' processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    shown = io.StringIO()
    try:
        with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
            code = cli.main(["benchmark", *argv])
    finally:
        torch.set_num_threads(threads)
    return code, shown.getvalue()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("profiled")
    code, shown = benchmark(*TINY, "--profile", str(tmp / "prof"), "--output", str(tmp / "r.json"))
    assert code == 0, shown
    return tmp / "prof", read_record(tmp / "r.json")


@pytest.fixture(scope="module")
def timed(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("timed")
    code, shown = benchmark(*TINY, "--output", str(tmp / "r.json"), "--plot", str(tmp / "mem.png"))
    assert code == 0, shown
    assert f"memory picture: {tmp / 'mem.png'}" in shown
    assert (tmp / "mem.png").read_bytes().startswith(b"\x89PNG")  # the forecast over the step, the measured peak
    return read_record(tmp / "r.json")


def test_the_trace_loads_and_holds_the_steps_forward_and_backward(profiled):
    folder, record = profiled
    trace = trace_path(folder, 0)
    profile = record["results"]["profile"]
    assert profile["traces"] == [str(trace)] and profile["memory_snapshots"] == []  # CPU: no allocator snapshot
    events = json.load(gzip.open(trace, "rt"))["traceEvents"]
    ranges = Counter(e["name"] for e in events if e.get("cat") == "user_annotation")
    assert [ranges[f"ljperf.{name}"] for name in ("step", *PHASES)] == [2, 2, 2, 2]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::mm" and e["args"].get("Input Dims") for e in ops)  # with shapes
    assert any(e["name"].startswith("autograd::engine::evaluate_function") for e in ops)  # the backward's nodes


def test_profiled_steps_stay_out_of_the_timed_results(profiled):
    _, record = profiled
    res = record["results"]
    assert res["steps_completed"] == 3 and len(res["step_times_s"]) == 3 and len(res["losses"]) == 3
    assert res["profile"]["steps"] == 2 and len(res["profile"]["step_times_s"]) == 2
    jsonschema.validate(record, schema())


def test_the_profilers_breakdown_adds_up_to_the_profiled_steps(profiled):
    _, record = profiled
    bd = record["results"]["breakdown"]
    assert (bd["source"], bd["steps"], bd["ranks"]) == ("profiler", 2, 1)
    assert sum(bd["ms"].values()) == pytest.approx(bd["step_ms"], rel=1e-9)
    measured = 1e3 * statistics.mean(record["results"]["profile"]["step_times_s"])
    assert bd["step_ms"] == pytest.approx(measured, rel=0.05)  # the trace's step ranges are the loop's steps
    assert all(bd["ms"][name] > 0 for name in PHASES) and bd["ms"]["communication"] == 0  # one process
    assert 0 <= bd["pct"]["other"] < 25  # the step outside its phases: Python between them, a preemption


def test_the_timers_breakdown_adds_up_to_the_timed_steps(timed):
    res = timed["results"]
    bd = res["breakdown"]
    assert (bd["source"], bd["steps"], bd["note"]) == ("timers", 3, None)
    measured = 1e3 * statistics.mean(res["step_times_s"])
    assert sum(bd["ms"].values()) == pytest.approx(measured, rel=0.05)
    assert (
        all(bd["ms"][name] > 0 for name in PHASES) and 0 <= bd["pct"]["other"] < 25
    )  # the step outside its phases: Python between them, a preemption
    assert sum(bd["pct"].values()) == pytest.approx(100)
    jsonschema.validate(timed, schema())


def test_exposed_communication_is_a_collective_while_no_operator_runs():
    """A made-up trace: 100 µs steps; a collective on gloo's thread 60-90 µs, the main thread's matmul until 70 µs
    and its wait for the collective 80-90 µs: 20 µs exposed, taken from the backward (50-100 µs)."""

    def event(name: str, ts: float, dur: float, *, cat: str = "cpu_op", tid: int = 1) -> dict:
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}

    events = [
        event("ljperf.step", 0, 100, cat="user_annotation"),
        event("ljperf.forward", 0, 50, cat="user_annotation"),
        event("aten::mm", 0, 45),
        event("ljperf.backward", 50, 50, cat="user_annotation"),
        event("aten::mm", 50, 20),
        event("gloo:all_reduce", 60, 30, cat="user_annotation", tid=2),
        event("c10d::wait", 80, 10),
    ]
    (step,) = from_trace(events, device_type="cpu")
    assert {k: round(v * 1e6, 6) for k, v in step.items()} == {
        "step": 100,
        "communication": 20,
        "forward": 50,
        "backward": 30,
        "optimizer": 0,
    }


@pytest.mark.parametrize(
    ("where", "message"),
    [("/sys/ljperf-profile", "--profile '/sys/ljperf-profile': cannot make the folder"), ("FILE", "is a file")],
)
def test_profile_into_an_unwritable_folder_is_refused_before_the_run(tmp_path, where, message):
    if where == "FILE":
        (tmp_path / "FILE").write_text("x")
        where = str(tmp_path / "FILE")
    code, shown = benchmark(*TINY, "--profile", where, "--output", str(tmp_path / "r.json"))
    assert code == 2 and message in shown and len(shown.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()  # nothing ran


@pytest.mark.slow
def test_fsdp_on_two_processes_profiles_each_rank(tmp_path):
    folder = tmp_path / "prof"
    argv = ["--model", "fsdp/llama-tiny", "--seq-len", "32", "--warmup", "1", "--steps", "2", "--device", "cpu"]
    proc = run_ljperf(
        "benchmark", *argv, "--nproc-per-node", "2", "--profile", str(folder), "--output", str(tmp_path / "r.json")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = read_record(tmp_path / "r.json")["results"]
    assert res["profile"]["traces"] == [str(trace_path(folder, rank)) for rank in (0, 1)]
    for rank in (0, 1):
        events = json.load(gzip.open(trace_path(folder, rank), "rt"))["traceEvents"]
        assert sum(e.get("name") == "ljperf.step" for e in events) == 2
        assert any(str(e.get("name")).startswith("gloo:") for e in events)  # FSDP2's collectives
    bd = res["breakdown"]
    assert (bd["source"], bd["ranks"]) == ("profiler", 2) and bd["ms"]["communication"] > 0
    assert sum(bd["ms"].values()) == pytest.approx(bd["step_ms"], rel=1e-9)
