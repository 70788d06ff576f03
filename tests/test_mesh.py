"""Tensor parallel, HSDP and pipeline parallel on a device mesh (``--tp``, ``--dp-replicate``, ``--pp``): bad meshes
refused in-process, and the meshes trained on CPU (gloo) against DDP.

Run: ``.venv/bin/python -m pytest tests/test_mesh.py`` (the slow part: a 4-process, a 2-process and a 3-process
torchrun of tests/scripts/mesh_worker.py, started together).

Every run trains on the same global batch of 8 sequences a step (``SyntheticTokens`` splits one global batch over
the data-parallel ranks, and a tensor-parallel group shares its rank's): DDP on 4 ranks × 2 sequences is the
reference for ``--tp 2`` on 2 ranks (8 sequences each), ``--tp 2`` × FSDP2 on 4 (2 data-parallel ranks × 4) and
``--dp-replicate 2`` × 2 shards (4 data-parallel ranks × 2) and the 3-D mesh, ``--dp-replicate 2`` × 1 shard ×
``--tp 2`` (2 data-parallel ranks × 4); ``--pp 2`` on 2 ranks (4 micro-batches of 2), ``--pp 2`` × FSDP2 over 2 (2
micro-batches of 2 each) and ``--pp 2 --tp 2`` (2 micro-batches of 4); ``--pp 2 --loss chunked`` (its last stage
runs the chunked loss in its forward); ``--pp 3`` under 1F1B and under GPipe (4 micro-batches of 2: a middle stage
that receives and sends).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ljperf
from ljperf.cli import main
from ljperf.forecast import Recipe, forecast
from ljperf.models.spec import resolve
from ljperf.run.titles import run_title

from conftest import FORECAST_TOLERANCE, cli_env, read_record

WORKER = Path(__file__).parent / "scripts" / "mesh_worker.py"
ENGINES_WORKER = Path(__file__).parent / "scripts" / "engines_worker.py"
COMMON = "--seq-len 32 --steps 5 --warmup 1 --device cpu"
FOUR = {
    "ddp": f"--model torch/llama-tiny --micro-batch 2 {COMMON}",
    "tp2-fsdp2": f"--model fsdp/llama-tiny --tp 2 --micro-batch 4 {COMMON}",
    "hsdp2x2": f"--model fsdp/llama-tiny --dp-replicate 2 --micro-batch 2 {COMMON}",
    "pp2-fsdp2": f"--model fsdp/llama-tiny --pp 2 --pp-microbatches 2 --micro-batch 2 {COMMON}",
    "pp2-tp2": f"--model fsdp/llama-tiny --pp 2 --tp 2 --pp-microbatches 2 --micro-batch 4 {COMMON}",
    # the 3-D mesh: 2 replicas × 1 shard × tp 2 (one shard: no all-gather buffers, issue 59)
    "hsdp2x1-tp2": f"--model fsdp/llama-tiny --dp-replicate 2 --tp 2 --micro-batch 4 {COMMON}",
}
TWO = {
    "tp2": f"--model fsdp/llama-tiny --tp 2 --micro-batch 8 {COMMON}",
    "pp2": f"--model fsdp/llama-tiny --pp 2 --pp-microbatches 4 --micro-batch 2 {COMMON}",
    "pp2-chunked": f"--model fsdp/llama-tiny --pp 2 --pp-microbatches 4 --micro-batch 2 --loss chunked {COMMON}",
}
THREE = {
    "pp3": f"--model fsdp/llama-tiny --pp 3 --pp-microbatches 4 --micro-batch 2 {COMMON}",
    "pp3-gpipe": f"--model fsdp/llama-tiny --pp 3 --pp-microbatches 4 --micro-batch 2 --pp-schedule gpipe {COMMON}",
}
MESHES = {
    "tp2": (1, 1, 1, 2),
    "tp2-fsdp2": (1, 1, 2, 2),
    "hsdp2x2": (1, 2, 2, 1),
    "hsdp2x1-tp2": (1, 2, 1, 2),
    "pp2": (2, 1, 1, 1),
    "pp2-chunked": (2, 1, 1, 1),
    "pp2-fsdp2": (2, 1, 2, 1),
    "pp2-tp2": (2, 1, 1, 2),
    "pp3": (3, 1, 1, 1),
    "pp3-gpipe": (3, 1, 1, 1),
}
"""Each run's mesh: pp × dp_replicate × dp_shard × tp."""


# --- bad meshes: one line, exit 2, before any process starts ---

BAD = [
    (["benchmark", "--model", "deepspeed/llama-tiny", "--tp", "2"], "--tp builds a device mesh for the fsdp engine"),
    (["benchmark", "--model", "torch/llama-tiny", "--dp-replicate", "2"], "not torch"),
    (["plan", "--model", "fsdp/llama-tiny", "--gpus", "6", "--tp", "4"], "--tp 4 does not divide the world size 6"),
    (
        ["plan", "--model", "fsdp/llama-tiny", "--gpus", "8", "--tp", "2", "--dp-replicate", "3"],
        "--dp-replicate 3 × --tp 2 = 6 does not divide the world size 8",
    ),
    (["plan", "--model", "fsdp/llama-tiny", "--gpus", "8", "--tp", "4"], "must divide llama-tiny's K/V heads, 2"),
    (["plan", "--model", "fsdp/llama-tiny", "--gpus", "8", "--tp", "8"], "must divide llama-tiny's attention heads"),
    (
        ["plan", "--model", "fsdp/mixtral-tiny", "--gpus", "4", "--tp", "2"],
        "--tp splits Llama, Qwen 2, Qwen 3, Mistral",
    ),
    (["plan", "--model", "fsdp/llama-tiny", "--gpus", "2", "--tp", "2", "--seq-len", "33"], "must divide --seq-len 33"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a[3:]) + f" {a[0]}" for a, _ in BAD])
def test_a_bad_mesh_exits_2_with_one_line(argv, message, capsys):
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


# --- the meshes, trained: one 4-process and one 2-process launch ---


def _launch(processes: int, out: Path, runs: dict[str, str], *, worker: Path = WORKER) -> subprocess.Popen:
    specs = [f"{name}={args}" for name, args in runs.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), str(worker), str(out)]
    return subprocess.Popen([*cmd, *specs], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The launches at once: {name: (record, worst relative gradient difference per parameter or None)}."""
    out = tmp_path_factory.mktemp("mesh")
    procs = [_launch(4, out, FOUR), _launch(2, out, TWO), _launch(3, out, THREE)]
    for proc in procs:
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, output[-4000:]
    grads = {name: read_record(out / f"{name}.grads.json") for name in MESHES}
    return {name: (read_record(out / f"{name}.json"), grads.get(name)) for name in [*FOUR, *TWO, *THREE]}


@pytest.mark.slow
def test_each_mesh_trains_with_ddps_losses(runs):
    """Same seed, same global batch: the losses of 5 steps agree within 1e-4 relative (measured: 6.4e-8)."""
    reference = runs["ddp"][0]["results"]["losses"]
    assert len(reference) == 5
    for name, (pp, dp_replicate, dp_shard, tp) in MESHES.items():
        record = runs[name][0]
        assert record["results"]["status"] == "ok", (name, record["results"]["reason"])
        assert record["config"]["mesh"] == {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
        assert record["config"]["engine"]["mesh"] == record["config"]["mesh"]
        assert record["results"]["losses"] == pytest.approx(reference, rel=1e-4), name


@pytest.mark.slow
def test_one_steps_gradients_equal_one_models_on_the_global_batch(runs):
    """Every parameter's gradient, gathered whole, within 1e-5 of its largest value (measured: at most 1.1e-6)."""
    for name in MESHES:
        worst = runs[name][1]
        assert len(worst) == 39, name  # llama-tiny's parameters, none left out
        assert max(worst.values()) < 1e-5, (name, max(worst, key=worst.get))


@pytest.mark.slow
def test_tokens_count_a_tensor_parallel_group_once(runs):
    """Throughput is of the sequences trained: a group of ``tp`` ranks shares its sequences."""
    for name, (pp, dp_replicate, dp_shard, tp) in MESHES.items():
        record = runs[name][0]
        assert record["config"]["tokens_per_step"] == 8 * 32, name
        results = record["results"]
        world = record["config"]["launch"]["world_size"]
        assert results["tokens_per_s_per_device"] == pytest.approx(results["tokens_per_s"] / world)
        assert results["tokens_per_s"] == pytest.approx(8 * 32 / results["step_time_s_p50"])
        assert pp * dp_replicate * dp_shard * tp == world


@pytest.mark.slow
def test_forecast_within_tolerance_of_each_ranks_peak(runs):
    """The forecast each mesh's record holds (``ljperf plan --tp/--dp-replicate/--pp`` on the same recipe) against
    the peak every rank measured, within ``FORECAST_TOLERANCE`` (0.5%); under ``--pp``, each pipeline rank's own
    forecast. Measured: -0.02% to -0.00% on every rank but the pipelines' last stages, -0.10% to -0.18%, and
    ``--pp 3``'s first and middle stages, +0.13% and -0.27% (1F1B), -0.29% (GPipe). A stage
    that sends its output on keeps it until its backward ends, and 1F1B's last warm-up send keeps its micro-batch's
    until the steady state ends (``walk.outputs_let_go``; ``--pp 2 --tp 2``'s first stage was +0.67% when the walk
    counted the output twice in flight), and the stages' receive buffers are counted from the step's start."""
    for name, (pp, *_) in MESHES.items():
        results = runs[name][0]["results"]
        forecast = results["forecast"]
        predicted = forecast.get("peak_allocated_bytes_per_pp_rank") or [forecast["peak_allocated_bytes"]]
        assert len(predicted) == pp, name
        per_rank = results["peak_allocated_bytes_per_rank"]
        for rank, measured in enumerate(per_rank):
            expected = predicted[rank // (len(per_rank) // pp)]
            assert abs(expected - measured) / measured < FORECAST_TOLERANCE, (name, predicted, per_rank)


@pytest.mark.slow
def test_plan_forecasts_what_the_benchmark_forecast(runs, capsys):
    """``ljperf plan --tp 2`` (--dp-replicate 2) on the runs' recipes, from the traces the runs cached: the same
    peak as the benchmark's forecast, the mesh in its JSON and its title."""
    plan = ["plan", "--model", "fsdp/llama-tiny", "--device", "cpu", "--gpus", "4", "--seq-len", "32"]
    flags = {"tp2-fsdp2": ["--tp", "2", "--micro-batch", "4"], "hsdp2x2": ["--dp-replicate", "2", "--micro-batch", "2"]}
    for name, mesh in flags.items():
        assert main([*plan, *mesh, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        pp, dp_replicate, dp_shard, tp = MESHES[name]
        assert report["recipe"]["mesh"] == {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
        assert report["peak_allocated_bytes"] == runs[name][0]["results"]["forecast"]["peak_allocated_bytes"]
    assert main([*plan, *flags["hsdp2x2"]]) == 0
    assert "4 × cpu (2 replicas × 2 shards × tp 1)" in capsys.readouterr().out


@pytest.mark.slow
def test_the_benchmark_table_names_the_mesh(runs):
    titles = {name: run_title(runs[name][0]["config"]) for name in ("ddp", *MESHES)}
    assert "4 process(es) × 1 thread(s) · mb 2" in titles["ddp"]
    assert "2 process(es) × 1 thread(s) (1 shard × tp 2) ·" in titles["tp2"]
    assert "4 process(es) × 1 thread(s) (2 shards × tp 2) ·" in titles["tp2-fsdp2"]
    assert "4 process(es) × 1 thread(s) (2 replicas × 2 shards × tp 1) ·" in titles["hsdp2x2"]


# --- tensor parallel's activations: a model whose peak is in its blocks, at two sequence lengths ---

WIDE = {**json.loads((Path(ljperf.__file__).parent / "models" / "catalog" / "llama-tiny.json").read_text())}
WIDE.update(vocab_size=256, hidden_size=256, intermediate_size=704)
"""llama-tiny 2× as wide with a vocabulary of 256: the logits no longer dwarf the blocks' activations, so the
peak moves from the loss into the backward, where the gathered inputs of the column-wise projections live."""
SEQ_LENS = (64, 256)


@pytest.fixture(scope="module")
def wide_tp2_runs(tmp_path_factory):
    """One 2-process launch of ``--tp 2`` on ``WIDE`` at each of ``SEQ_LENS``: {seq_len: record}."""
    out = tmp_path_factory.mktemp("wide-tp2")
    config = out / "llama-wide.json"
    config.write_text(json.dumps(WIDE))
    common = f"--model-config {config} --engine fsdp --tp 2 --micro-batch 4 --steps 2 --warmup 1 --device cpu"
    runs = {f"s{seq}": f"{common} --seq-len {seq}" for seq in SEQ_LENS}
    proc = _launch(2, out, runs, worker=ENGINES_WORKER)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-4000:]
    return {seq: read_record(out / f"s{seq}.json") for seq in SEQ_LENS}


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_tensor_parallel_forecast_within_half_a_percent_of_each_ranks_peak(wide_tp2_runs, seq_len):
    """Sequence parallel's sharded norms and residuals and the whole inputs the projections keep for the backward,
    as traced on a fake process group, against each rank of the real gloo step (measured: -0.00% on both ranks at
    both lengths in most runs; in 1 run of 5, one rank 262,144 bytes higher at 64 tokens, -0.83%, one gathered
    input of 4 × 64 × 256 fp32: an all-gather's output in the backward freed two matmuls after its copy, not
    at it, most likely as gloo's thread lets go of it, a CPU count's timing like #59 item 1's; once -0.45% at
    256). A fake wait of a functional collective once made a copy of its output, a real one returns it: +1.2% at
    256 tokens."""
    results = wide_tp2_runs[seq_len]["results"]
    assert results["status"] == "ok", results["reason"]
    predicted = results["forecast"]["peak_allocated_bytes"]
    for measured in results["peak_allocated_bytes_per_rank"]:
        assert abs(predicted - measured) / measured < 0.005, (
            seq_len,
            predicted,
            results["peak_allocated_bytes_per_rank"],
        )
    assert results["forecast"]["phase"].startswith("backward"), results["forecast"]["phase"]


@pytest.mark.slow
def test_a_tensor_parallel_forecast_traces_after_this_process_destroyed_its_process_groups(tmp_path, monkeypatch):
    """``destroy_process_group`` drops every group name this process registered, the forecast's fake ``tp`` group
    with them: the next ``--tp`` trace could not resolve it and fell back to the analytic formula."""
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(tmp_path))
    spec = resolve(name="llama-tiny")
    recipe = Recipe(engine="fsdp", world=2, device="cpu", micro_batch=2, seq_len=32, tp=2)
    assert forecast(spec, recipe).source == "traced"
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())
    torch.distributed.destroy_process_group()
    assert forecast(spec, recipe.with_(recompute=("full",) * spec.layers)).source == "traced"
