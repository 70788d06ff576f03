"""``ljperf benchmark`` end to end on CPU: the record, the numbers in it, DDP, and bad input."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from importlib import resources

import jsonschema
import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from ljperf.benchmark.config import config_from_args
from ljperf.benchmark.data import SyntheticTokens
from ljperf.benchmark.loop import run_worker
from ljperf.benchmark.record import memory_results
from ljperf.commands import benchmark as benchmark_command
from ljperf.distributed import memory
from ljperf.models.build import materialize
from ljperf.models.spec import build_meta, resolve
from ljperf.models.step import causal_lm_loss
from ljperf.run.context import unjoined

from conftest import FORECAST_TOLERANCE, cli_env, read_record, run_ljperf, run_main

TINY = ["--model", "torch/llama-tiny", "--seq-len", "128"]


def schema() -> dict:
    return json.loads(resources.files("ljperf").joinpath("schemas", "benchmark-result.schema.json").read_text())


@pytest.fixture(scope="module")
def twenty_steps(tmp_path_factory):
    """A 20-step run in this process: its record and what it printed."""
    out = tmp_path_factory.mktemp("bench") / "result.json"
    code, stdout, stderr = run_main(
        None, "benchmark", *TINY, "--micro-batch", "2", "--steps", "20", "--output", str(out)
    )
    assert code == 0, stderr
    return read_record(out), stdout


def test_record_validates_against_the_documented_schema(twenty_steps):
    record, _ = twenty_steps
    jsonschema.validate(record, schema())
    res = record["results"]
    assert res["status"] == "ok" and res["steps_completed"] == 20 and len(res["losses"]) == 20
    assert res["peak_reserved_bytes"] is None and res["mfu"] is None  # CPU: no allocator, no known peak
    # CPU seconds of each step: within its wall time on this process's threads (and one more, its own helpers)
    most = (record["config"]["train"]["threads"] or 1) + 1
    assert all(0 < c <= most * w for c, w in zip(res["step_cpu_times_s"], res["step_times_s"], strict=True))


def test_a_cpu_record_holds_the_allocator_retries_and_oom_count_each_null(twenty_steps):
    """``num_alloc_retries`` and ``num_ooms`` (CUDA's caching allocator, as torchtitan reports them) are in every
    record, per rank too; null on a CPU, which has no caching allocator to retry or count."""
    res = twenty_steps[0]["results"]
    for key in ("num_alloc_retries", "num_ooms"):
        assert key in res and res[key] is None, key
        assert res[f"{key}_per_rank"] == [None], key


def test_the_records_memory_figures_are_each_ranks_and_their_maximum():
    """As a CUDA run of three ranks fills them, one rank's unknown (a failed run knows only its own)."""

    def cuda(allocated: int, retries: int, ooms: int) -> memory.MemoryStats:
        return memory.MemoryStats(peak_allocated=allocated, peak_reserved=allocated + 1, num_alloc_retries=retries,
                                  num_ooms=ooms, method=memory.CUDA_METHOD)  # fmt: skip

    out = memory_results([cuda(100, 0, 0), None, cuda(90, 4, 1)])
    assert out == {
        "peak_allocated_bytes": 100, "peak_allocated_bytes_per_rank": [100, None, 90],
        "peak_reserved_bytes": 101, "peak_reserved_bytes_per_rank": [101, None, 91],
        "num_alloc_retries": 4, "num_alloc_retries_per_rank": [0, None, 4],
        "num_ooms": 1, "num_ooms_per_rank": [0, None, 1],
    }  # fmt: skip
    assert memory_results([None])["num_ooms"] is None


def test_a_default_device_record_calibrates_the_cpu(twenty_steps, tmp_path):
    """A CPU run without ``--device`` (``auto``) records the device that ran and fits the overheads CPU forecasts
    use, named ``cpu``; so does an older record, which kept ``auto``."""
    from ljperf.forecast import calibrate

    record, _ = twenty_steps
    assert record["config"]["train"]["device"] == "cpu"
    older = json.loads(json.dumps(record))
    older["config"]["train"]["device"] = "auto"
    for i, rec in enumerate((record, older)):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(rec))
        assert list(calibrate.calibrate([str(path)], out=tmp_path / f"calibration{i}.json")) == ["cpu"]


def test_throughput_arithmetic(twenty_steps):
    record, _ = twenty_steps
    res, cfg = record["results"], record["config"]
    assert cfg["tokens_per_step"] == 2 * 128 * 1 * 1
    assert res["tokens_per_s"] == pytest.approx(cfg["tokens_per_step"] / res["step_time_s_p50"])
    flops = resolve(name="llama-tiny").flops_per_token(128)
    assert res["tflops_per_device"] == pytest.approx(res["tokens_per_s_per_device"] * flops / 1e12)
    assert res["step_time_s_p50"] <= res["step_time_s_p90"]


def test_loss_decreases_over_twenty_steps(twenty_steps):
    losses = twenty_steps[0]["results"]["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1


def test_table_is_printed(twenty_steps):
    _, stdout = twenty_steps
    for text in ("tokens/s", "step time p50", "peak allocated", "ok"):
        assert text in stdout


def test_every_step_time_printed_names_its_statistic(twenty_steps):
    """The table said ``step time p50 60.6 ms`` and the breakdown below it ``step 67.0 ms`` (its mean)."""
    record, stdout = twenty_steps
    res = record["results"]
    p50_row = next(line for line in stdout.splitlines() if "step time p50 (median)" in line)
    assert f"{res['step_time_s_p50'] * 1e3:.1f}" in p50_row
    assert "step time breakdown (timers, mean of 20 steps)" in stdout
    step_row = next(line for line in stdout.splitlines() if "step (mean)" in line)
    assert f"{res['breakdown']['step_ms']:.1f}" in step_row
    # the phase clock's steps, timed beside the loop's own: the same mean within its timer's overhead
    assert res["breakdown"]["step_ms"] == pytest.approx(res["step_time_s_mean"] * 1e3, rel=0.01)


def test_peak_memory_at_least_the_training_state(twenty_steps):
    record, _ = twenty_steps
    params = record["config"]["model"]["params"]
    # fp32 AdamW: parameters, gradients and two moments are 16 bytes per parameter, plus activations.
    assert record["results"]["peak_allocated_bytes"] > 16 * params


def test_cpu_memory_measurement_agrees_with_torch_memtracker():
    spec = resolve(name="llama-tiny")
    model = materialize(build_meta(spec), device=torch.device("cpu"), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, spec.vocab, (2, 128))

    def step():
        causal_lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with memory.LiveTensorBytes([*memory.training_state_tensors(model, opt), tokens]) as ours:
        step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert ours.peak == pytest.approx(theirs, rel=0.01)


def _let_go(holder: list, *, freed_by: str) -> None:
    """Drop the last reference ``holder`` keeps, on this thread or on another (as gloo's thread does)."""
    if freed_by == "this thread":
        holder.clear()
        return
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()


@pytest.mark.parametrize("freed_by", ["gloo's thread", "this thread"])
def test_a_collectives_copy_freed_late_on_another_thread_counts_only_until_it_was_seen(freed_by):
    """gloo copies a collective's input where the dispatcher does not see it; the count sees the copy when the
    calling thread views it, and its Python storage object makes gloo's thread wait for the GIL to free it, up to
    tens of milliseconds after the collective (FSDP2's reduce-scatter copy, alive into the embedding's backward
    on some ranks: +6.8%). Freed on another thread, it is taken back from what came after it was seen; a storage
    this thread frees counts until it is freed."""
    copy = torch.empty(1000)  # made unseen, as gloo makes its copy
    with memory.LiveTensorBytes() as tracker:
        copy.split(500)  # the calling thread views it while the collective runs
        holder = [copy]
        del copy
        later = torch.empty(2000)  # after the collective
        _let_go(holder, freed_by=freed_by)
    assert tracker.current == later.nbytes
    assert tracker.peak == (later.nbytes if freed_by == "gloo's thread" else later.nbytes + 4000)


def test_a_collectives_output_freed_late_on_another_thread_counts_until_it_was_last_used():
    """A functional collective's output (tensor parallel's all-gathers) is held by gloo's work too; when that is
    its last reference gloo's thread frees it late, after the GIL (at 64 tokens of ``--tp 2``, a gathered input
    of 262,144 bytes two matmuls on in 3 runs of 10). Freed on another thread (here, or gloo's own when its work
    still holds it), it is taken back from what came after the calling thread last read it."""
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())
    try:
        name = torch.distributed.group.WORLD.group_name
        shard = torch.ones(250)
        with memory.LiveTensorBytes() as tracker:
            gathered = torch.ops._c10d_functional.all_gather_into_tensor(shard, 1, name)  # 1,000 bytes
            gathered = torch.ops._c10d_functional.wait_tensor(gathered)
            doubled = gathered * 2  # its last use: 2,000 bytes alive
            holder = [gathered]
            del gathered
            later = torch.empty(2000)  # 8,000 bytes
            _let_go(holder, freed_by="gloo's thread")
    finally:
        torch.distributed.destroy_process_group()
    assert tracker.current == doubled.nbytes + later.nbytes
    assert tracker.peak == doubled.nbytes + later.nbytes


def test_an_all_gather_buffer_freed_late_on_another_thread_counts_until_it_was_last_used():
    """FSDP2 all-gathers into a buffer it makes (``torch.empty``, seen) with ``dist.all_gather_into_tensor``, copies
    the parameters out into storages it made before (``split_with_sizes_copy(out=)``) and drops it; gloo's work may
    still hold it, and gloo's thread then frees it after the next block's buffer is made (``--tp 2`` × FSDP2: the
    root's gathered buffer alive at the last layer's prefetch in the backward, +369,664 bytes, 3.9%, on one rank of
    4 in 3 runs of 5). Freed on another thread, it is taken back from everything after the calling thread last read
    it: the copy-out made nothing, so the next buffer's making comes after."""
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())
    try:
        shard = torch.ones(250)
        with memory.LiveTensorBytes([shard]) as tracker:
            params = torch.empty(250)  # the unsharded parameters: 1,000 bytes
            buffer = torch.empty(250)  # 1,000 bytes
            torch.distributed.all_gather_into_tensor(buffer, shard, async_op=True).wait()
            params.copy_(buffer)  # the copy-out: its last use
            holder = [buffer]
            del buffer
            prefetched = torch.empty(2000)  # the next block's buffer: 8,000 bytes
            _let_go(holder, freed_by="gloo's thread")
    finally:
        torch.distributed.destroy_process_group()
    assert tracker.current == shard.nbytes + params.nbytes + prefetched.nbytes
    assert tracker.peak == shard.nbytes + params.nbytes + prefetched.nbytes


def test_a_tensor_handed_to_a_gloo_collective_and_freed_on_another_thread_counts_until_it_was_last_used():
    """ZeRO-1/2 flatten each bucket (``allreduce_bucket``) and hand it to gloo's reduce; gloo's work holds it too,
    and when the calling thread lets go first gloo's thread frees it, after the GIL (ZeRO-2 at b1 s32: 20.20 MB
    in one run, 20.96 MB in another). Freed on another thread, it is taken back from what came after the calling
    thread last read it."""
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())
    try:
        with memory.LiveTensorBytes() as tracker:
            flat = torch.cat([torch.ones(250), torch.ones(250)])  # 2,000 bytes
            torch.distributed.reduce(flat, 0)
            first = flat.narrow(0, 0, 250) * 2  # its last use: 3,000 bytes alive
            holder = [flat]
            del flat
            later = torch.empty(1000)  # 4,000 bytes
            _let_go(holder, freed_by="gloo's thread")
            waited = 0
            while tracker.current > first.nbytes + later.nbytes and waited < 500:  # gloo's work may hold it still
                threading.Event().wait(0.01)
                waited += 1
    finally:
        torch.distributed.destroy_process_group()
    assert tracker.current == first.nbytes + later.nbytes
    assert tracker.peak == first.nbytes + later.nbytes


@pytest.mark.slow
def test_ddp_matches_single_process_for_the_same_global_batch(tmp_path, capsys):
    """The one-process runs run in this process; DDP's two ranks are processes."""
    single, ddp, accum = tmp_path / "single.json", tmp_path / "ddp.json", tmp_path / "accum.json"
    common = [*TINY, "--steps", "5", "--warmup", "1"]
    assert run_main(capsys, "benchmark", *common, "--micro-batch", "4", "--output", str(single))[0] == 0
    assert (
        run_main(capsys, "benchmark", *common, "--micro-batch", "2", "--grad-accum", "2", "--output", str(accum))[0]
        == 0
    )
    proc = run_ljperf("benchmark", *common, "--micro-batch", "2", "--nproc-per-node", "2", "--output", str(ddp))
    assert proc.returncode == 0, proc.stderr
    ref = read_record(single)["results"]["losses"]
    assert read_record(ddp)["results"]["losses"] == pytest.approx(ref, rel=1e-5)
    assert read_record(accum)["results"]["losses"] == pytest.approx(ref, rel=1e-5)
    ddp_record = read_record(ddp)
    assert ddp_record["env"]["world_size"] == 2
    assert len(ddp_record["results"]["peak_allocated_bytes_per_rank"]) == 2


@pytest.mark.parametrize("seed", [0, 2**62, 2**63 - 1])
def test_every_accepted_seed_draws_a_token_stream(seed):
    """``--seed`` takes 0..2^63-1; from about 1.8e14 the stream's seed had overflowed torch's 64-bit generator."""
    data = SyntheticTokens(vocab=256, seq_len=16, micro_batch=2, grad_accum=1, world=1, seed=seed)
    first = data.micro_batches(3, 0, torch.device("cpu"))
    assert torch.equal(first[0], data.micro_batches(3, 0, torch.device("cpu"))[0])
    assert not torch.equal(first[0], data.micro_batches(4, 0, torch.device("cpu"))[0])


def test_injected_oom_is_recorded_with_exit_3(tmp_path, monkeypatch, capsys):
    out = tmp_path / "oom.json"
    monkeypatch.setenv("LJPERF_FAULT", "oom,step=3")
    code, stdout, stderr = run_main(capsys, "benchmark", *TINY, "--steps", "3", "--output", str(out))
    assert code == 3
    assert "Traceback" not in stderr
    record = read_record(out)
    jsonschema.validate(record, schema())
    res = record["results"]
    assert res["status"] == "oom" and res["steps_completed"] == 0
    # No step timed: every figure a finished run has, each null (the mean, HFU and the peak used were missing)
    figures = ("step_time_s_p50", "step_time_s_mean", "tokens_per_s", "tflops_per_device", "mfu", "hfu")
    assert all(res[key] is None for key in (*figures, "peak_tflops_per_device"))
    # The forecast is kept beside the peak measured before the OOM (step 2, untimed).
    assert abs(res["forecast"]["error_pct"]) < 100 * FORECAST_TOLERANCE, res["forecast"]
    assert "memory forecast" in stdout


def test_a_cpu_run_beyond_the_ram_is_refused_as_oom_with_its_record(tmp_path, capsys):
    """70B in fp32 on CPU: the forecast (over 1 TiB) says no machine here holds it, so the run ends as oom at
    once with a record, instead of being killed by the kernel minutes into building the model."""
    out = tmp_path / "r.json"
    code, _, stderr = run_main(
        capsys, "benchmark", "--model", "torch/llama3.1-70b", "--device", "cpu", "--output", str(out)
    )
    assert code == 3 and "Traceback" not in stderr, stderr
    res = read_record(out)["results"]
    assert res["status"] == "oom" and res["forecast"]["peak_allocated_bytes"] > 2**40
    assert "of RAM available: not started, the kernel would kill it; even one sequence" in res["reason"]
    assert stderr.strip().splitlines() == [f"ljperf benchmark: oom: {res['reason']}; result record: {out}"]


@pytest.mark.parametrize(
    ("ram_between", "fix"),
    [
        (("full", "none"), "; --recompute auto would fit"),
        (("full at micro batch 1", "full"), "; --recompute full with --micro-batch "),
        ((None, "full at micro batch 1"), "; even one sequence with --recompute full would not fit"),
    ],
)
def test_the_refusal_names_what_would_fit_in_the_ram(ram_between, fix, monkeypatch):
    """The fix named is checked against the forecast: RAM set between two plans' forecast peaks."""
    from ljperf.benchmark.memory_check import check_memory
    from ljperf.core import hardware
    from ljperf.forecast import Recipe, forecast

    parser = argparse.ArgumentParser()
    benchmark_command.add_arguments(parser)
    argv = [*TINY, "--device", "cpu", "--micro-batch", "4"]
    run = unjoined(config_from_args(parser.parse_args(argv), argv))
    recipe = Recipe.from_run(run)
    full = ("full",) * run.model.layers
    peaks = {
        "none": forecast(run.model, recipe).peak_allocated_bytes,
        "full": forecast(run.model, recipe.with_(recompute=full)).peak_allocated_bytes,
        "full at micro batch 1": forecast(run.model, recipe.with_(recompute=full, micro_batch=1)).peak_allocated_bytes,
        None: 0,
    }
    low, high = (peaks[k] for k in ram_between)
    assert low < high
    monkeypatch.setattr(hardware, "available_ram", lambda: hardware.host_ram_needed((low + high) // 2, processes=1))
    with pytest.raises(MemoryError, match=fix):
        check_memory(run, None)
    # A forecast that fits exactly runs, with what a process holds beyond its tensors; without it, not.
    needed = hardware.host_ram_needed(peaks["none"], processes=1)
    monkeypatch.setattr(hardware, "available_ram", lambda: needed)
    check_memory(run, None)
    margin = r"per process × 1: .* with what a process holds beyond its tensors \(5% and 256 MiB\) > "
    for ram in (needed - 1, peaks["none"]):
        monkeypatch.setattr(hardware, "available_ram", lambda ram=ram: ram)
        with pytest.raises(MemoryError, match=margin):
            check_memory(run, None)


def test_a_refused_cpu_run_prints_its_reason_as_lines_and_a_shorter_sequence_that_fits(tmp_path, monkeypatch, capsys):
    """The README's first line on a CPU: the reason sat in the status cell of a table of dashes, and its only fix
    (full recompute of a 1B model) takes minutes a step here. The shorter sequence named fits by the forecast,
    twice it does not."""
    from ljperf.core import hardware
    from ljperf.forecast import Recipe, forecast
    from ljperf.models.spec import resolve

    spec = resolve(name="llama-tiny")
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=4, seq_len=2048)
    ram = hardware.host_ram_needed(forecast(spec, recipe.with_(seq_len=512)).peak_allocated_bytes, processes=1)
    monkeypatch.setattr(hardware, "available_ram", lambda: ram)
    out = tmp_path / "r.json"
    argv = ["benchmark", *TINY, "--device", "cpu", "--micro-batch", "4", "--seq-len", "2048", "--output", str(out)]
    code, stdout, _ = run_main(capsys, *argv)
    assert code == 3 and "┃ metric" not in stdout and "oom, nothing measured:" in stdout, stdout
    assert "  faster on a CPU: --seq-len 512 without recompute" in stdout.splitlines()
    assert "faster on a CPU: --seq-len 512 without recompute" in read_record(out)["results"]["reason"]


def test_the_memory_check_uses_the_devices_calibration(tmp_path, monkeypatch):
    """The check forecasts as the record does, with this device's saved calibration: a calibration that doubles
    the forecast refuses a run that the uncalibrated forecast would have let start."""
    from ljperf.benchmark.memory_check import check_memory
    from ljperf.core import hardware
    from ljperf.forecast import Recipe, forecast

    from conftest import stale_calibration_cache

    parser = argparse.ArgumentParser()
    benchmark_command.add_arguments(parser)
    argv = [*TINY, "--device", "cpu"]
    run = unjoined(config_from_args(parser.parse_args(argv), argv))
    uncalibrated = forecast(run.model, Recipe.from_run(run)).peak_allocated_bytes
    monkeypatch.setattr(hardware, "available_ram", lambda: hardware.host_ram_needed(uncalibrated * 3 // 2, processes=1))
    check_memory(run, None)
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(stale_calibration_cache(tmp_path, scale=2.0)))
    with pytest.raises(MemoryError, match="of RAM available: not started"):
        check_memory(run, None)


@pytest.mark.slow
def test_a_gpu_run_over_its_memory_is_told_what_would_fit():
    """On CUDA the check only warns (the run goes on); its fix may add GPUs, which on CPU share one RAM. Only the
    forecast runs here: an 8B recipe on one 80 GB GPU."""
    import dataclasses

    from ljperf.benchmark.memory_check import shortfall
    from ljperf.core.hardware import DeviceInfo
    from ljperf.distributed.runtime import Process

    parser = argparse.ArgumentParser()
    benchmark_command.add_arguments(parser)
    argv = ["--model", "torch/llama3-8b", "--device", "cpu", "--precision", "bf16-mixed", "--seq-len", "4096"]
    run = unjoined(config_from_args(parser.parse_args(argv), argv))
    run = dataclasses.replace(run, process=Process(device=DeviceInfo(type="cuda", index=None, name="NVIDIA H100")))
    head, fix = shortfall(run, None, memory=80 * 10**9, processes=1, device_name="NVIDIA H100")
    assert head.startswith("forecast ") and head.endswith(" per process × 1 > 74.51 GiB")
    # fused AdamW, the CUDA default, keeps no foreach lists of the shard: 2 GPUs fit (with foreach it took 4)
    assert fix == "with --recompute full, would fit with FSDP2 (engine fsdp) on 2 GPUs"
    assert shortfall(run, None, memory=2**40, processes=1, device_name="NVIDIA H100") is None


@pytest.mark.slow
def test_a_benchmark_of_a_model_that_fails_to_trace_records_the_analytic_forecast_its_reason_and_error(tmp_path):
    """The catalog's MoE model with transformers' experts loop (``nonzero``: no shape on fake tensors). Measured:
    -0.4% (the loop's activations were uncounted before: -14.9%)."""
    from ljperf.models.catalog import read_config_dict

    config, out = tmp_path / "config.json", tmp_path / "result.json"
    config.write_text(json.dumps({**read_config_dict(name="mixtral-tiny"), "experts_implementation": "eager"}))
    shape = ["--seq-len", "128", "--micro-batch", "2", "--precision", "fp32", "--steps", "2"]
    code, stdout, stderr = run_main(None, "benchmark", "--model-config", str(config), *shape, "--output", str(out))
    assert code == 0, stderr
    record = read_record(out)
    jsonschema.validate(record, schema())
    fc = record["results"]["forecast"]
    assert fc["source"] == "analytic" and "DynamicOutputShape" in fc["analytic_reason"]
    assert abs(fc["error_pct"]) <= 2, fc
    assert "by the analytic formula, not traced: its training step does not run on fake tensors" in stdout


def test_a_forecast_that_fails_is_one_warning_line_and_no_figure(capsys):
    """A recipe the forecast refuses (here no precision): the run goes on without ``results.forecast``; the
    warning is one ``warning:`` line on stderr (it was a UserWarning naming benchmark.py, as long as the error)."""
    from ljperf.benchmark.memory_check import benchmark_forecast
    from ljperf.core.options import TrainConfig

    parser = argparse.ArgumentParser()
    benchmark_command.add_arguments(parser)
    argv = [*TINY, "--device", "cpu"]
    run = unjoined(config_from_args(parser.parse_args(argv), argv))
    run.config.train = TrainConfig(device="cpu")
    assert benchmark_forecast(run, {}, None) is None
    assert capsys.readouterr().err.splitlines() == [
        "warning: no memory forecast for this run (UsageError: --precision None: choose one of fp32, bf16-mixed, bf16)"
    ]


# The full matrix runs in test_cli_inputs.py; the first here also end to end, in a process of its own.
BAD_INPUTS = [
    (["--model", "torch/llama-tinyy"], "closest: llama-tiny"),
    (["--model", "torch/llama-tiny", "--nproc-per-node", "64"], "--nproc-per-node 64"),
    (["--model", "torch/llama-tiny", "--output", "/nonexistent/dir/r.json"], "does not exist"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    """Exit 2 and one line, from ``ljperf.cli.main``; the first input also from a ``python -m ljperf`` process (its
    exit status, and nothing else on its stderr)."""
    if args == BAD_INPUTS[0][0]:
        proc = run_ljperf("benchmark", *args, timeout=120)
        code, stderr = proc.returncode, proc.stderr
    else:
        code, _, stderr = run_main(capsys, "benchmark", *args)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr


@pytest.mark.slow
def test_runs_under_a_users_own_torchrun(tmp_path):
    out = tmp_path / "r.json"
    args = ["benchmark", *TINY, "--steps", "3", "--warmup", "1", "--output", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ljperf", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:  # a hung rank must not outlive the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-2000:]
    record = read_record(out)
    assert record["env"]["world_size"] == 2 and record["results"]["status"] == "ok"
    launch = record["config"]["launch"]  # torchrun's numbers, not ljperf's flags' defaults (it said 1 per node)
    assert (launch["nproc_per_node"], launch["nnodes"], launch["world_size"]) == (2, 1, 2)


@pytest.mark.slow
def test_a_users_torchrun_checks_the_output_before_training(tmp_path):
    """Rank 0 checks --output under any torchrun (it was skipped there: the run trained, then lost its record in a
    FileNotFoundError traceback), and says so though rank 1 finds it first (rank 1's exit had torchrun stop rank 0
    before its line, half the time on a busy machine; here rank 0 starts 3 s late)."""
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n"
    )
    args = ["benchmark", *TINY, "--steps", "50", "--output", str(tmp_path / "missing" / "r.json")]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = cli_env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "late"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([*torchrun, "-m", "ljperf", *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ljperf benchmark:")]
    assert errors == [
        f"ljperf benchmark: error: --output {args[-1]!r}: folder {str(tmp_path / 'missing')!r} does not exist"
    ]
    assert "FileNotFoundError" not in proc.stderr and "loss" not in proc.stdout


def test_a_record_that_cannot_be_written_is_one_line_and_exit_1(tmp_path, capsys):
    """The folder is checked before the run; if it goes during the run, the end says so (was a traceback)."""
    folder = tmp_path / "gone"
    folder.mkdir()
    parser = argparse.ArgumentParser()
    benchmark_command.add_arguments(parser)
    argv = [*TINY, "--device", "cpu", "--steps", "1", "--warmup", "0", "--output", str(folder / "r.json")]
    cfg = config_from_args(parser.parse_args(argv), argv)
    folder.rmdir()
    assert run_worker(cfg) == 1
    err = capsys.readouterr().err
    assert f"ljperf benchmark: the record could not be written to {folder / 'r.json'}: " in err
    assert "Traceback" not in err


def test_a_table_title_prints_on_one_line():
    """rich wraps a title to its table's width; ljperf's tables are made wide enough for theirs (plan's wrapped
    between 'seq' and '8192')."""
    from rich.console import Console

    from ljperf.core.console import titled_table

    title = "deepspeed/llama3-8b · 8 × cuda · mb 1 × seq 8192 × accum 1 · bf16-mixed"
    table = titled_table(title)
    table.add_column("GiB")
    table.add_row("77.91")
    console = Console(width=200, record=True)
    console.print(table)
    assert title in console.export_text()


def test_a_record_names_the_ljperf_version_also_when_run_from_a_source_tree():
    """The GPU session runs ljperf from ``src`` on PYTHONPATH, with no distribution installed: its tables read
    ``ljperf None``. Here ``-S`` leaves out site-packages, where this checkout's editable install is."""
    import ljperf

    src = str(resources.files("ljperf").joinpath(".."))
    code = "import json; from ljperf.core.records import versions; print(json.dumps(versions()))"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env={**cli_env(), "PYTHONPATH": src}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ljperf"] == ljperf.__version__


def test_a_title_names_a_catalog_model_as_engine_slash_name_and_a_config_path_as_itself():
    from ljperf.run.titles import shape_title

    shape = {"micro_batch": 2, "seq_len": 64, "grad_accum": 1, "precision": "fp32"}
    title = "torch/llama-tiny · 1 process(es) · mb 2 × seq 64 × accum 1 · fp32"
    assert shape_title("torch", "llama-tiny", where="1 process(es)", shape=shape) == title
    title = "fsdp · /data/config.json · 2 process(es) · mb 2 × seq 64 × accum 1 · fp32"
    assert shape_title("fsdp", "/data/config.json", where="2 process(es)", shape=shape) == title


def test_a_runs_title_names_its_zero_stage_and_fsdp2s_shards_and_reshard_setting():
    """A user could not see that a --deepspeed-config's stage 2 was honoured without --json."""
    from ljperf.run.titles import run_title

    train = {"micro_batch": 1, "seq_len": 32, "grad_accum": 1, "precision": "fp32", "device": "cuda"}
    base = {"model": {"name": "llama-tiny"}, "launch": {"world_size": 2}, "train": train}
    zero2 = run_title({**base, "engine": {"name": "deepspeed", "zero_stage": 2}})
    assert zero2 == "deepspeed/llama-tiny · 2 process(es) · ZeRO-2 · mb 1 × seq 32 × accum 1 · fp32"
    fsdp = {"name": "fsdp", "mesh": {"dp_replicate": 1, "dp_shard": 2, "tp": 1}, "reshard_after_forward": False}
    assert " · FSDP2 over 2 shards, no reshard after forward · " in run_title({**base, "engine": fsdp})
    hsdp = {**base, "mesh": {"dp_replicate": 2, "dp_shard": 1, "tp": 1}, "engine": {**fsdp, "mesh": {}}}
    assert "2 process(es) (2 replicas × 1 shard × tp 1) · FSDP2, no reshard after forward · mb" in run_title(hsdp)
    assert run_title({**base, "engine": {"name": "torch"}}).startswith("torch/llama-tiny · 2 process(es) · mb 1 ×")


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.4),  # as torch.cuda.get_device_name reports it
        ("NVIDIA H200 NVL", 835.0),  # the PCIe card: was the SXM part's 989.4 (MFU 16% low)
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_bf16_tflops_of_a_device_name(name, tflops):
    from ljperf.core.hardware import peak_tflops

    assert peak_tflops(name) == tflops


def test_a_cpu_run_sets_and_records_its_threads_and_says_when_nobody_chose(tmp_path, monkeypatch, capsys):
    """CPU step times followed the thread count (ratios 1.26-1.55 apart with torch's default, 1.009 with one)."""
    from ljperf.cli import main

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    previous = torch.get_num_threads()
    out = tmp_path / "r.json"
    run = ["benchmark", "--model", "torch/llama-tiny", "--seq-len", "32", "--steps", "1", "--warmup", "0"]
    run += ["--output", str(out)]
    try:
        assert main([*run, "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
        assert json.loads(out.read_text())["config"]["train"]["threads"] == 1
        assert "--threads N" not in capsys.readouterr().err
        assert main(run) == 0
    finally:
        torch.set_num_threads(previous)
    assert "give --threads N (or OMP_NUM_THREADS) to compare runs" in capsys.readouterr().err
    assert json.loads(out.read_text())["config"]["train"]["threads"] >= 1


@pytest.mark.gpu
def test_a_cuda_record_holds_the_allocators_peaks_retries_and_oom_count(tmp_path, capsys):
    """On CUDA the caching allocator's figures are measured, not null as on a CPU: its peak reserved holds its peak
    allocated, and a tiny model's run neither retries an allocation nor runs out."""
    out = tmp_path / "r.json"
    code, _, stderr = run_main(capsys, "benchmark", *TINY, "--device", "cuda", "--steps", "3", "--output", str(out))
    assert code == 0, stderr
    res = read_record(out)["results"]
    assert res["status"] == "ok" and res["peak_reserved_bytes"] >= res["peak_allocated_bytes"] > 0
    assert (res["num_alloc_retries"], res["num_ooms"]) == (0, 0)
    assert (res["num_alloc_retries_per_rank"], res["num_ooms_per_rank"]) == ([0], [0])
