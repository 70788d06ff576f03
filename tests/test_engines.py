"""The engines: each through the ``Engine`` protocol alone (one process), the DeepSpeed config rules, and real
2-process runs of FSDP2 and DeepSpeed ZeRO on CPU (gloo).

Run: ``.venv/bin/python -m pytest tests/test_engines.py`` (the slow part: one torchrun of all engines, ~1-2 min).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ljperf.benchmark.config import config_from_args
from ljperf.benchmark.data import SyntheticTokens
from ljperf.benchmark.loop import measured_memory_step
from ljperf.cli import build_parser
from ljperf.commands import benchmark as benchmark_command
from ljperf.core import deepspeed_config as dsc
from ljperf.core.errors import UsageError
from ljperf.distributed import memory
from ljperf.distributed.runtime import free_port, shutdown_process
from ljperf.engines import Engine, make_engine
from ljperf.models.catalog import read_config_dict
from ljperf.models.spec import build_meta
from ljperf.run.context import init_process, unjoined

from conftest import cli_env, read_record, run_main

WORKER = Path(__file__).parent / "scripts" / "engines_worker.py"
COMMON = "--seq-len 32 --micro-batch 1 --grad-accum 2 --steps 5 --warmup 1 --device cpu"
# qwen-tiny ties its LM head to the embedding (as llama3.2-1b/3b do): each engine must keep them one parameter.
ENGINES = {
    "ddp": "--model torch/qwen-tiny",
    "fsdp": "--model fsdp/qwen-tiny",
    "zero1": "--model deepspeed/qwen-tiny --zero-stage 1",
    "zero2": "--model deepspeed/qwen-tiny --zero-stage 2",
    "zero3": "--model deepspeed/qwen-tiny --zero-stage 3 --deepspeed-config {prefetch}",
    # The catalog's real models say "torch_dtype": "bfloat16"; ljperf still trains fp32 master weights.
    "fsdp-bf16-config": "--model-config {bf16_config} --engine fsdp",
    # bf16 weights, gradients and moments (no fp32 master), as a model loaded in bfloat16 trains
    "ddp-bf16": "--model torch/qwen-tiny --precision bf16",
    "fsdp-bf16": "--model fsdp/qwen-tiny --precision bf16",
}
PARAMS = 1_001_600  # qwen-tiny, the tied weight counted once


def opts(**overrides) -> dsc.Options:
    base = dict(
        micro_batch=1, grad_accum=2, world=2, bf16=False, zero_stage=3, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
        weight_decay=0.1, hidden=128,
    )  # fmt: skip
    return dsc.Options(**{**base, **overrides})


def levels(findings: list[dsc.Finding]) -> list[str]:
    return [f.level for f in findings]


# --- each engine through the Engine protocol alone, in this process ---

PROTOCOL_ENGINES = ("torch", "fsdp", "deepspeed")
PROTOCOL_STEPS = 3
"""Steps before the measured one: it is the steady state's (optimizer states made in step 1)."""


def through_the_protocol(engine: Engine, *, argv: list[str]) -> dict:
    """Build and train ``engine`` with the protocol's methods alone, as the benchmark loop does: the steps' losses,
    the measured step's memory, what the engine holds and its record."""
    cfg = config_from_args(build_parser("benchmark").parse_args(argv), argv)
    engine.setup(build_meta(cfg.model, attn_implementation=cfg.train.attn_implementation))
    train = cfg.train
    data = SyntheticTokens(vocab=cfg.model.vocab, seq_len=train.seq_len, micro_batch=train.micro_batch,
                           grad_accum=train.grad_accum, world=1, seed=train.seed)  # fmt: skip
    cpu = torch.device("cpu")
    losses = [float(engine.train_step(data.micro_batches(step, 0, cpu))) for step in range(PROTOCOL_STEPS)]
    run = init_process(unjoined(cfg), need_group=True)
    loss, stats = measured_memory_step(run, engine, data.micro_batches(PROTOCOL_STEPS, 0, cpu))
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in engine.state_tensors()}
    return {
        "losses": [*losses, float(loss)],
        "memory": stats,
        "state_bytes": sum(storages.values()),
        "local_params": engine.local_params(),
        "record": engine.describe().record(),
        "model": engine.model,
    }


@pytest.fixture(scope="module")
def protocol_runs() -> dict[str, dict]:
    """Each engine made by ``make_engine`` and driven by ``through_the_protocol``, one after another in this
    process, on a gloo group of this process alone (FSDP2 and DeepSpeed need one). What they change for the rest
    of a process is put back after: the environment (DeepSpeed sets ``LOCAL_RANK``), the group, and ``F.linear``
    (ZeRO-3 replaces it with its memory-efficient one for good; a later test of this worker counted its matmuls)."""
    environ, linear = dict(os.environ), torch.nn.functional.linear
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        runs = {}
        for name in PROTOCOL_ENGINES:
            argv = ["benchmark", "--model", f"{name}/qwen-tiny", *shlex.split(COMMON)]
            cfg = config_from_args(build_parser("benchmark").parse_args(argv), argv)
            runs[name] = through_the_protocol(make_engine(init_process(unjoined(cfg), need_group=True)), argv=argv)
        return runs
    finally:
        shutdown_process()
        os.environ.clear()
        os.environ.update(environ)
        torch.nn.functional.linear = linear


def test_every_engine_trains_to_the_same_losses_through_the_protocol(protocol_runs):
    """fp32 at one seed: FSDP2 and ZeRO-3 on one rank give the torch engine's losses (as on two ranks below)."""
    reference = protocol_runs["torch"]["losses"]
    assert len(reference) == PROTOCOL_STEPS + 1 and all(0 < x < 20 for x in reference)
    for name in PROTOCOL_ENGINES:
        assert protocol_runs[name]["losses"] == pytest.approx(reference, rel=1e-5), name


def test_every_engine_reports_its_memory_and_its_record_through_the_protocol(protocol_runs):
    """The measured step's figures on CPU (live tensor storages from what the engine keeps: at least fp32
    parameters and two AdamW moments), null where only CUDA's allocator counts; the record's ``config.engine``."""
    for name in PROTOCOL_ENGINES:
        run = protocol_runs[name]
        assert run["local_params"] == pytest.approx(PARAMS, rel=0.01), name  # one rank holds every parameter
        assert run["state_bytes"] >= 12 * run["local_params"], name
        stats = run["memory"]
        assert stats.peak_allocated > run["state_bytes"], name  # the step's activations and gradients on top
        assert (stats.peak_reserved, stats.num_alloc_retries, stats.num_ooms) == (None, None, None), name
        assert stats.method == memory.CPU_METHOD
        record = run["record"]
        assert record["name"] == name and record["local_params"] == run["local_params"], name
        assert record["optimizer"].startswith(("AdamW", "torch.optim.AdamW")), name
        assert json.loads(json.dumps(record)) == record, name
        assert isinstance(run["model"], torch.nn.Module), name
    assert protocol_runs["torch"]["record"]["wrapper"] == "none"
    assert protocol_runs["fsdp"]["record"]["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert protocol_runs["deepspeed"]["record"]["zero_stage"] == 3


PROTOCOL_PROBE = """
import torch

from ljperf.engines import Engine, EngineRecord
from ljperf.engines.deepspeed_engine import DeepSpeedEngine
from ljperf.engines.fsdp_engine import FSDPEngine
from ljperf.engines.torch_engine import TorchEngine


class WithoutStateTensors:
    model: torch.nn.Module

    def setup(self, model: torch.nn.Module) -> None: ...
    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor: ...
    def local_params(self) -> int: ...
    def describe(self) -> EngineRecord: ...


def engines(a: TorchEngine, b: FSDPEngine, c: DeepSpeedEngine) -> list[Engine]:
    return [a, b, c]


def refused(d: WithoutStateTensors) -> Engine:
    return d
"""


def test_the_type_checker_takes_each_engine_class_as_an_engine_and_refuses_one_without_a_method(tmp_path):
    """pyrefly (the project's type checker) on a file that assigns each engine class to the ``Engine`` protocol:
    no error for the three; one for a class without ``state_tensors``, naming it. (An engine that lost a method
    fails here and in ``create(run) -> Engine`` of its module.)"""
    probe = tmp_path / "probe.py"
    probe.write_text(PROTOCOL_PROBE)
    pyrefly = Path(sys.executable).parent / "pyrefly"
    cmd = [str(pyrefly), "check", str(probe), "--python-interpreter-path", sys.executable]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "`WithoutStateTensors` is not assignable" in errors[0], out
    line = 1 + PROTOCOL_PROBE.splitlines().index("    return d")
    assert f"probe.py:{line}:" in out and "Protocol `Engine` requires attribute `state_tensors`" in out, out


# --- the lint and the config rules (no processes) ---


def test_lint_clean_config_is_all_ok():
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    assert levels(dsc.lint(config, world_size=2)) == ["ok"] * 7


def test_lint_batch_identity_fails_with_the_numbers():
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    (finding,) = [f for f in dsc.lint(config, world_size=2) if f.level == "fail"]
    assert finding.message == "train_batch_size 16 ≠ 2 (micro) × 2 (accumulation) × 2 (world) = 8"
    assert "8" in finding.fix
    # Without a world size: only a multiple of micro × accumulation can be asked for.
    assert "fail" not in levels(dsc.lint(config))
    assert "fail" in levels(dsc.lint({**config, "train_batch_size": 6}))


def test_lint_fails_a_train_batch_size_the_known_factors_do_not_divide():
    """DeepSpeed derives what is left out by integer division (micro = 12 // 8 = 1) and then fails its own check."""
    (finding,) = [f for f in dsc.lint({"train_batch_size": 12}, world_size=8) if f.level == "fail"]
    assert finding.message.startswith("train_batch_size 12 is not divisible by 8 (world):")
    assert finding.fix == 'set train_batch_size to a multiple of 8 (8 or 16), or "auto"'
    accum = {"train_batch_size": 12, "gradient_accumulation_steps": 2}
    (finding,) = [f for f in dsc.lint(accum, world_size=4) if f.level == "fail"]
    assert "12 is not divisible by 2 (accumulation) × 4 (world) = 8" in finding.message
    micro = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}
    assert "fail" in levels(dsc.lint(micro))  # no world size: the micro batch alone must divide it
    for config, world in ((accum, 3), ({"train_batch_size": 16}, 8), ({"train_batch_size": 12}, None)):
        assert "fail" not in levels(dsc.lint(config, world_size=world)), (config, world)


def test_settings_take_the_configs_numbers_where_no_flag_is_given():
    user = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}}
    none = dict(micro_batch=None, grad_accum=None, zero_stage=None, source="my.json")
    assert dsc.settings(user, **none) == dsc.Settings(micro_batch=4, grad_accum=8, zero_stage=2)
    given = dsc.settings(user, **(none | dict(micro_batch=2, zero_stage=3)))
    assert given == dsc.Settings(micro_batch=2, grad_accum=8, zero_stage=3)  # resolve then refuses 2 vs 4
    assert dsc.settings({}, **none) == dsc.Settings(micro_batch=1, grad_accum=1, zero_stage=3)
    # "auto" is the flag's default; 2.0 and "2" are read as DeepSpeed reads them, and written as numbers, with a
    # warning (a quoted stage stood for 3, the default, and then contradicted it)
    odd = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2.0, "bf16": {"enabled": "no"}}
    odd["zero_optimization"] = {"stage": "2"}
    assert dsc.settings(odd, **none) == dsc.Settings(micro_batch=1, grad_accum=2, zero_stage=2)
    [quoted, *rest] = dsc.check(dsc.merge(odd), dsc.settings(odd, **none), world=2, bf16=False, source="my.json")
    assert (
        quoted.message
        == (
            'gradient_accumulation_steps is 2.0, read as 2; zero_optimization.stage is "2", read as 2; '
            'bf16.enabled is "no", read as false'
        )
        and rest == []
    )
    config, _ = dsc.resolve(dsc.merge(odd), opts(micro_batch=1, zero_stage=2), source="my.json")
    assert (config["gradient_accumulation_steps"], config["zero_optimization"]["stage"]) == (2, 2)
    assert config["bf16"]["enabled"] is False and config["train_batch_size"] == 4
    with pytest.raises(UsageError, match=r'zero_optimization.stage is "2" but ljperf runs --zero-stage 3'):
        dsc.check(dsc.merge(odd), dsc.settings(odd, **none | {"zero_stage": 3}), world=2, bf16=False, source="my")
    # A number ljperf cannot run, standing in for a flag: refused with the flag's rule (it said "ljperf runs
    # --zero-stage 3", a flag nobody gave)
    for stage, why in ((0, "--zero-stage 0: choose 1, 2 or 3"), ("two", 'want an integer, or "auto"')):
        with pytest.raises(UsageError, match=f"^my.json sets zero_optimization.stage to {json.dumps(stage)}, which "):
            dsc.settings({"zero_optimization": {"stage": stage}}, **none)
        with pytest.raises(UsageError, match=why):
            dsc.settings({"zero_optimization": {"stage": stage}}, **none)
    assert [f.level for f in dsc.lint({"zero_optimization": {"stage": 7}})][-1] == "fail"  # doctor's lint too
    assert [f.level for f in dsc.lint({"zero_optimization": {"stage": "0"}})][-1] == "ok"


def test_lint_warns_numeric_prefetch_and_unknown_keys_and_fails_two_precisions():
    config = {
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7},
        "train_micro_batch_size": 1,
        "bf16": {"enabled": True},
        "fp16": {"enabled": True},
    }
    finite, unknown, batch, precision, prefetch, types, stage = dsc.lint(config)
    assert finite.level == "ok"
    assert unknown.level == "warn" and "train_micro_batch_size_per_gpu" in unknown.message  # the close match
    assert batch.level == "ok"
    assert precision.level == "fail" and "bf16 and fp16" in precision.message
    assert prefetch.level == "warn" and '"auto"' in prefetch.fix
    assert types.level == "ok"  # 5e7 is a number (a wrong one for this key, which prefetch names)
    assert stage.level == "ok"
    auto = {"zero_optimization": {"stage3_prefetch_bucket_size": "auto"}}
    assert dsc.lint(auto)[4].level == "ok"


def test_generated_config_resolves_every_auto_and_keeps_prefetch_auto():
    config, warnings = dsc.resolve(dsc.merge({}), opts(), source="ljperf")
    assert warnings == []
    assert config["train_batch_size"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["optimizer"]["params"] == {
        "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True
    }  # fmt: skip
    assert config["gradient_clipping"] == 0.0
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 1280
    assert config["bf16"] == {"enabled": False} and config["fp16"] == {"enabled": False}


def test_user_config_merges_and_contradictions_are_usage_errors():
    user = {"zero_optimization": {"overlap_comm": True}, "train_micro_batch_size_per_gpu": "auto"}
    config, _ = dsc.resolve(dsc.merge(user), opts(), source="my.json")
    assert config["zero_optimization"]["overlap_comm"] is True and config["zero_optimization"]["stage"] == 3
    with pytest.raises(UsageError, match=r"zero_optimization.stage is 2 but ljperf runs --zero-stage 3"):
        dsc.resolve(dsc.merge({"zero_optimization": {"stage": 2}}), opts(), source="my.json")
    with pytest.raises(UsageError, match=r"train_batch_size 16 ≠ 1 \(micro\) × 2 \(accumulation\) × 2 \(world\) = 4"):
        dsc.resolve(dsc.merge({"train_batch_size": 16}), opts(), source="my.json")


def test_cli_wrong_batch_identity_exits_2_before_any_process_starts(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1}))
    code, _, stderr = run_main(
        capsys, "benchmark", "--model", "deepspeed/llama-tiny", "--nproc-per-node", "2", "--device", "cpu",
        "--deepspeed-config", str(bad),
    )  # fmt: skip
    assert code == 2, stderr
    assert "train_batch_size 16 ≠ 1 (micro) × 1 (accumulation) × 2 (world) = 2" in stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1


def test_benchmark_takes_batch_and_stage_from_the_deepspeed_config_unless_a_flag_is_given(tmp_path, capsys):
    """The same rules as ``ljperf plan`` (``deepspeed_config.settings``): checked before any process starts."""
    path = tmp_path / "ds.json"
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}}
    path.write_text(json.dumps(config))
    parser = argparse.ArgumentParser()
    benchmark_command.add_arguments(parser)
    argv = ["--model", "deepspeed/llama-tiny", "--device", "cpu", "--deepspeed-config", str(path)]
    cfg = config_from_args(parser.parse_args(argv), argv)
    assert (cfg.train.micro_batch, cfg.train.grad_accum, cfg.engine_opts.zero_stage) == (4, 8, 2)
    code, _, stderr = run_main(capsys, "benchmark", *argv, "--zero-stage", "3")
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "zero_optimization.stage is 2 but ljperf runs --zero-stage 3" in stderr


# --- real runs: every engine once, 2 processes, gloo ---


@pytest.fixture(scope="module")
def launch_dir(tmp_path_factory) -> Path:
    """The folder of ``runs``' launch: its records, configs and torch's extension folder."""
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def runs(launch_dir):
    """One torchrun launch that runs every engine through the benchmark path; the records and the ranks' stderr."""
    out = launch_dir
    prefetch = out / "prefetch.json"
    prefetch.write_text(json.dumps({"zero_optimization": {"stage3_prefetch_bucket_size": 50_000_000}}))
    bf16_config = out / "qwen-tiny-bf16.json"
    bf16_config.write_text(json.dumps({**read_config_dict(name="qwen-tiny"), "torch_dtype": "bfloat16"}))
    specs = [
        f"{name}={args.format(prefetch=prefetch, bf16_config=bf16_config)} {COMMON}" for name, args in ENGINES.items()
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(WORKER), str(out), *specs]
    env = cli_env(TORCH_EXTENSIONS_DIR=str(out / "extensions"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: read_record(out / f"{name}.json") for name in ENGINES}, proc.stderr


@pytest.mark.slow
def test_deepspeed_on_cpu_builds_no_op(runs, launch_dir):
    """ZeRO-1/2/3 trained on CPU without JIT-building DeepSpeed's shared-memory comm op (inference only):
    the extension folder of the launch holds no built library."""
    records, _ = runs
    assert all(records[name]["results"]["status"] == "ok" for name in ("zero1", "zero2", "zero3"))
    assert not list((launch_dir / "extensions").rglob("*.so"))


@pytest.mark.slow
def test_losses_of_all_engines_agree(runs):
    """fp32 master weights against DDP's losses (measured: at most 6.4e-8 relative); bf16 weights against DDP's in
    bf16 (FSDP2's gathered weights run bf16 kernels that round otherwise: measured 6.2e-5, so 3e-4)."""
    records, _ = runs
    for name, record in records.items():
        assert record["results"]["status"] == "ok", (name, record["results"]["reason"])
        bf16 = name.endswith("-bf16")
        reference = records["ddp-bf16" if bf16 else "ddp"]["results"]["losses"]
        assert len(reference) == 5
        assert record["results"]["losses"] == pytest.approx(reference, rel=3e-4 if bf16 else 1e-5), name


@pytest.mark.slow
def test_fsdp_and_zero3_hold_half_of_the_parameters_per_rank(runs):
    records, _ = runs
    for name in ("fsdp", "fsdp-bf16-config", "zero3"):
        assert records[name]["config"]["engine"]["local_params"] == pytest.approx(PARAMS / 2, rel=0.01), name
    for name in ("zero1", "zero2"):  # parameters replicated; only optimizer states (and gradients) partitioned
        assert records[name]["config"]["engine"]["local_params"] == PARAMS


@pytest.mark.slow
def test_memory_is_recorded_for_every_rank(runs):
    records, _ = runs
    for name, record in records.items():
        res = record["results"]
        per_rank = res["peak_allocated_bytes_per_rank"]
        assert len(per_rank) == 2 and all(x > 0 for x in per_rank), name
        assert res["peak_allocated_bytes"] == max(per_rank)
    ddp = records["ddp"]["results"]["peak_allocated_bytes"]
    # Measured on CPU (fp32, accumulation 2): DDP 23.2 MB (buckets), FSDP2 13.8, ZeRO-1 17.2, ZeRO-2 17.6, ZeRO-3 19.4.
    for name in ("fsdp", "zero1", "zero2", "zero3"):
        assert records[name]["results"]["peak_allocated_bytes"] < ddp, name


@pytest.mark.slow
def test_resolved_deepspeed_config_and_prefetch_warning_are_recorded(runs):
    records, stderr = runs
    generated = records["zero1"]["config"]["engine"]["deepspeed_config"]
    assert generated["zero_optimization"]["stage"] == 1
    assert generated["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    assert generated["train_batch_size"] == 1 * 2 * 2
    user = records["zero3"]["config"]["engine"]
    assert user["deepspeed_config"]["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert any("stage3_prefetch_bucket_size" in w for w in user["warnings"])
    (warning,) = (line for line in stderr.splitlines() if "stage3_prefetch_bucket_size" in line)
    assert warning.startswith("warning: zero_optimization.stage3_prefetch_bucket_size is a fixed number (50000000)")
    assert '; fix: leave it out or set it to "auto"' in warning
    assert stderr.count("Setting accelerator to") <= 1, stderr[-3000:]  # said by rank 0 only (was once per rank)


@pytest.mark.slow
def test_two_nodes_on_localhost(tmp_path):
    """Two launches of one process each, c10d rendezvous on 127.0.0.1: one FSDP run over two "nodes"."""
    port = free_port()
    env = cli_env(LJPERF_RDZV_ID=f"ljperf-test-{port}")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ljperf",
                "benchmark",
                "--model",
                "fsdp/llama-tiny",
                *COMMON.split(),
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--nproc-per-node",
                "1",
                "--output",
                str(tmp_path / f"node{rank}.json"),
                "--collective-timeout",
                "120",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    record = read_record(tmp_path / "node0.json")
    assert record["results"]["status"] == "ok"
    assert record["config"]["launch"]["world_size"] == 2
    assert len(record["results"]["peak_allocated_bytes_per_rank"]) == 2
    assert record["config"]["engine"]["local_params"] == pytest.approx(1_262_720 / 2, rel=0.01)  # llama-tiny
