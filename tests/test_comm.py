"""``ljperf comm``: nccl-tests' bandwidth arithmetic, the result check, and a real 2-process gloo run."""

from __future__ import annotations

import argparse
import json
import os
import signal

import pytest
import torch

from ljperf.cli import main
from ljperf.comm import bench as comm
from ljperf.comm.config import OPS
from ljperf.core import hardware
from ljperf.core import options as cfgmod
from ljperf.core.errors import UsageError

from conftest import run_ljperf


@pytest.mark.parametrize(
    ("op", "world", "algbw", "busbw"),
    [
        # 1 GB in 10 ms is 100 GB/s of algbw; busbw per nccl-tests' PERFORMANCE.md.
        ("all_reduce", 8, 100.0, 175.0),  # × 2(n-1)/n
        ("all_reduce", 2, 100.0, 100.0),
        ("all_gather", 8, 100.0, 87.5),  # × (n-1)/n
        ("reduce_scatter", 4, 100.0, 75.0),  # × (n-1)/n
        ("all_to_all", 16, 100.0, 93.75),  # × (n-1)/n
        ("broadcast", 8, 100.0, 100.0),  # × 1
        ("all_reduce", 1, 100.0, 0.0),
    ],
)
def test_bandwidth_matches_nccl_tests(op, world, algbw, busbw):
    got = comm.bandwidth(op, 10**9, 0.01, world=world)
    assert got == pytest.approx((algbw, busbw))


def test_sizes_and_counts():
    cfg = comm.CommConfig(ops="all_reduce, broadcast", min_bytes="1K", max_bytes="1M", step_factor=4)
    assert cfg.op_list == ["all_reduce", "broadcast"]
    assert cfg.sizes == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert comm.CommConfig(ops="all").op_list == list(OPS)
    assert comm.CommConfig(min_bytes="1M", max_bytes="3M").sizes == [2**20, 2**21]
    assert comm.CommConfig(max_bytes="4K").sizes == [1024, 2048, 4096]  # --min-bytes defaults to 1K
    # --max-bytes below that default alone is one size, not exit 2 (as on the command line: the flag left out)
    parser = argparse.ArgumentParser()
    cfgmod.add_arguments(parser, comm.CommConfig)
    small = cfgmod.from_args(comm.CommConfig, parser.parse_args(["--max-bytes", "5"]))
    assert small.sizes == [5] and small.min_bytes == "5"
    # nccl-tests' sizes: the whole buffer; split ops round to a multiple of the world size.
    assert comm.element_count("all_reduce", 1000, element_size=4, world=3) == 250
    assert comm.element_count("all_gather", 1000, element_size=4, world=3) == 249
    assert comm.element_count("reduce_scatter", 4, element_size=4, world=8) == 8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ops": "allreduce"},
        {"min_bytes": "2M", "max_bytes": "1M"},
        {"min_bytes": "1K", "max_bytes": "5"},  # a given min larger than the max is still refused
        {"min_bytes": "lots"},
        {"step_factor": 1},
        {"iters": 0},
        {"dtype": "int8"},
    ],
)
def test_bad_options_are_usage_errors(kwargs):
    with pytest.raises(UsageError):
        comm.CommConfig(**kwargs)


def simulate(op: str, world: int, count: int) -> list[torch.Tensor]:
    """Each rank's output of ``op`` computed by hand from every rank's input (what the collective must do)."""
    chunk = count // world
    inputs = [comm.pattern(torch.arange(count if op != "all_gather" else chunk), r) for r in range(world)]
    total = torch.stack(inputs).sum(0)
    if op == "all_reduce":
        return [total] * world
    if op == "broadcast":
        return [inputs[0]] * world
    if op == "all_gather":
        return [torch.cat(inputs)] * world
    if op == "reduce_scatter":
        return [total[r * chunk : (r + 1) * chunk] for r in range(world)]
    return [torch.cat([inputs[p][r * chunk : (r + 1) * chunk] for p in range(world)]) for r in range(world)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_check_agrees_with_a_hand_simulation(op, world):
    count = 6 * world
    for rank, out in enumerate(simulate(op, world, count)):
        got = out.to(torch.bfloat16)
        assert comm.count_wrong(op, got, rank=rank, world=world, chunk=count // world) == 0
        broken = got.clone()
        broken[-1] += 1
        broken[0] = -1
        assert comm.count_wrong(op, broken, rank=rank, world=world, chunk=count // world) == 2


@pytest.mark.slow
def test_two_process_gloo_run(tmp_path):
    out = tmp_path / "comm.json"
    proc = run_ljperf(
        "comm",
        "--nproc-per-node",
        "2",
        "--device",
        "cpu",
        "--min-bytes",
        "1K",
        "--max-bytes",
        "64K",
        "--step-factor",
        "4",
        "--iters",
        "3",
        "--warmup-iters",
        "1",
        "--output",
        str(out),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "busbw" in proc.stdout and "avg bus bandwidth" in proc.stdout
    record = json.loads(out.read_text())
    assert record["kind"] == "comm" and record["schema_version"] == 1
    assert record["env"]["world_size"] == 2 and record["config"]["backend"] == "gloo"
    results = record["results"]
    assert results["status"] == "ok" and results["wrong"] == 0
    rows = results["rows"]
    assert [r["op"] for r in rows] == [op for op in OPS for _ in range(4)]
    assert [r["size_bytes"] for r in rows[:4]] == [1024, 4096, 16384, 65536]
    for r in rows:
        assert r["wrong"] == 0 and r["time_us"] > 0 and r["count"] * 4 == r["size_bytes"]
        algbw = r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9
        assert r["algbw_gbps"] == pytest.approx(algbw)
        assert r["busbw_gbps"] == pytest.approx(algbw * comm.BUS_FACTOR[r["op"]](2))
    for op, value in results["avg_busbw_gbps"].items():
        assert value == pytest.approx(sum(r["busbw_gbps"] for r in rows if r["op"] == op) / 4)


@pytest.mark.slow
def test_memory_running_out_keeps_the_sizes_measured_before(tmp_path):
    """A real allocation failure under 1.3 GB of address space above the imports (at 256 or 512 MiB: thread
    arenas vary the room left): exit 3, one line, and the record and table hold the sizes done before it."""
    out = tmp_path / "c.json"
    sizes = ["--min-bytes", "128M", "--max-bytes", "4G", "--iters", "1", "--warmup-iters", "0"]
    args = ["comm", "--device", "cpu", "--ops", "all_reduce", *sizes, "--output", str(out)]
    proc = run_ljperf(*args, timeout=120, memory_above_imports=1300 * 10**6)
    res = json.loads(out.read_text())["results"]
    assert proc.returncode == 3 and proc.stderr.strip().splitlines() == [f"ljperf comm: failed: {res['reason']}"]
    assert res["status"] == "oom" and res["reason"].startswith("out of host memory")
    done = [r["size_bytes"] for r in res["rows"]]
    assert done in ([2**27], [2**27, 2**28]) and all(str(size) in proc.stdout for size in done)


def test_a_size_beyond_the_ram_is_refused_before_it_is_allocated(tmp_path):
    """Sizes the allocator grants but the RAM cannot hold (the kernel killed the process as the zeroed pages
    were written: exit 137, no record) are an out-of-memory record, exit 3, before any is allocated."""
    out = tmp_path / "c.json"
    beyond = 3 * hardware.available_ram() // 2
    sizes = ["--min-bytes", str(beyond), "--max-bytes", str(2 * beyond), "--iters", "1", "--warmup-iters", "0"]
    proc = run_ljperf("comm", "--device", "cpu", "--ops", "all_reduce", *sizes, "--output", str(out), timeout=60)
    res = json.loads(out.read_text())["results"]
    assert proc.returncode == 3 and proc.stderr.strip().splitlines() == [f"ljperf comm: failed: {res['reason']}"]
    assert res["status"] == "oom" and "of RAM is available to each" in res["reason"] and res["rows"] == []


def test_a_signal_keeps_the_sizes_measured_before(tmp_path, monkeypatch, capsys):
    """A real SIGTERM while the third size is measured (sent by the process to itself at that point)."""
    calls = []

    def measure(*args, **kwargs):
        calls.append(args[:2])
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    real = comm.measure
    monkeypatch.setattr(comm, "measure", measure)
    out = tmp_path / "c.json"
    sizes = ["--min-bytes", "1K", "--max-bytes", "4K", "--iters", "1", "--warmup-iters", "0"]
    assert main(["comm", "--device", "cpu", "--ops", "all_reduce,all_gather", *sizes, "--output", str(out)]) == 143
    res = json.loads(out.read_text())["results"]
    assert res["status"] == "error" and res["reason"] == "interrupted by SIGTERM"
    assert [(r["op"], r["size_bytes"]) for r in res["rows"]] == [("all_reduce", 1024), ("all_reduce", 2048)]
    assert capsys.readouterr().err.strip().splitlines() == ["ljperf comm: failed: interrupted by SIGTERM"]
    assert not torch.distributed.is_initialized()  # one rank: no peer to wait for, so the group is left


@pytest.mark.parametrize("signal_at", [None, 3])
def test_wrong_elements_fail_the_run_unless_a_signal_came_first(tmp_path, monkeypatch, capsys, signal_at):
    """A transport that corrupts one element (stood in by a wrapper around the real all_reduce): the #wrong column
    counts it and the run exits 1 with every size recorded; a SIGTERM later in the run keeps its own exit code."""
    real = comm.collective
    calls = []

    def collective(op):
        run = real(op)
        calls.append(op)
        if len(calls) == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)

        def corrupted(inp, out):
            run(inp, out)
            out[0] += 1

        return corrupted

    monkeypatch.setattr(comm, "collective", collective)
    out = tmp_path / "c.json"
    sizes = ["--min-bytes", "1K", "--max-bytes", "4K", "--iters", "1", "--warmup-iters", "0"]
    code = main(["comm", "--device", "cpu", "--ops", "all_reduce", *sizes, "--output", str(out)])
    res = json.loads(out.read_text())["results"]
    if signal_at is None:
        reason = "3 element(s) differ from the expected result (see the #wrong column)"
        assert (code, res["status"], res["reason"], res["wrong"]) == (1, "error", reason, 3)
    else:
        reason = "interrupted by SIGTERM"
        assert (code, res["status"], res["reason"], res["wrong"]) == (143, "error", reason, 2)
    assert [r["wrong"] for r in res["rows"]] == [1] * res["wrong"]
    assert capsys.readouterr().err.strip().splitlines() == [f"ljperf comm: failed: {reason}"]


def test_bad_flag_exits_2(capsys):
    assert main(["comm", "--ops", "all_reduce,gather"]) == 2
    assert "--ops 'all_reduce,gather'" in capsys.readouterr().err
