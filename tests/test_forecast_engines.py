"""The forecast of sharded and distributed engines: full-size fake steps against PyTorch's MemTracker (FSDP2: rank
0 on a fake process group), and two real CPU processes per run (DDP, FSDP2, ZeRO-1/2/3) against each rank's
measured peak; what ``ljperf plan`` reads of a DeepSpeed config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ljperf.benchmark import fakestep
from ljperf.benchmark.fakestep import fake_step_peak
from ljperf.cli import main
from ljperf.forecast import Recipe, forecast
from ljperf.forecast.blocks import block_params
from ljperf.forecast.recipe import ZeroSettings
from ljperf.models.catalog import read_config_dict, split_model_arg
from ljperf.models.spec import resolve

from conftest import FORECAST_TOLERANCE, read_record, run_ljperf

TOLERANCE = FORECAST_TOLERANCE
NEEDS_FSDP_TORCH = pytest.mark.skipif(
    fakestep.torch_version() < fakestep.FSDP_TORCH, reason="FSDP2's fake step counts DTensor's propagation before 2.13"
)
FULL_SIZE = [
    # (engine/model, world, recompute, micro batch, seq len, precision): catalog configs at full size, fake tensors.
    ("torch/llama3.2-1b", 1, "none", 1, 2048, "fp32"),
    # Autocast keeps a recomputed layer's bf16 weight copies until the forward ends: per layer, not per trace.
    ("torch/llama3.2-1b", 1, "full", 1, 2048, "bf16-mixed"),
    ("torch/llama3.2-1b", 1, "none", 1, 2048, "bf16"),
    # Alternating modes (qwen2.5-0.5b's 24 layers took 34 s of CI, most of it MemTracker: ops × live tensors)
    ("torch/llama3.2-1b", 1, "selective,none", 1, 2048, "bf16-mixed"),
    # The optimizer step sets the peak: single-tensor AdamW's temporaries are of rank 0's shard of the embedding.
    pytest.param("fsdp/llama3.2-1b", 2, "full", 1, 256, "bf16-mixed", marks=NEEDS_FSDP_TORCH),
    # bf16 weights (a model loaded in bfloat16, no mixed-precision policy): bf16 shards, moments and reduce
    pytest.param("fsdp/llama3.2-1b", 8, "full", 1, 2048, "bf16", marks=NEEDS_FSDP_TORCH),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "world", "recompute", "micro_batch", "seq_len", "precision"), FULL_SIZE)
def test_forecast_equals_memtracker_on_a_full_size_fake_step(model, world, recompute, micro_batch, seq_len, precision):
    """The 3-layer trace composed to 16 layers and extrapolated from ≤128 tokens to 2k, against PyTorch's
    MemTracker over the whole model's step (FSDP2: rank 0 on a fake process group). Deterministic, so 0.1%.
    Measured: exact (before: −12% with the config's bf16 weights traced, +7% with the autocast copies released
    once per trace, +2.4% with FSDP2's optimizer temporaries of the whole embedding)."""
    engine, name = split_model_arg(model)
    spec = resolve(name=name)
    modes = recompute.split(",")
    plan = tuple(modes[i % len(modes)] for i in range(spec.layers))
    recipe = Recipe(
        engine=engine,
        world=world,
        device="cpu",
        precision=precision,
        micro_batch=micro_batch,
        seq_len=seq_len,
        recompute=plan,
    )
    predicted = forecast(spec, recipe).peak_allocated_bytes
    measured = fake_step_peak(spec, recipe)
    assert predicted == pytest.approx(measured, rel=1e-3)


@NEEDS_FSDP_TORCH
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_fsdp2_root_regathered_in_backward_and_resharded_before_its_reduce(precision, world, tmp_path):
    """A root (embedding, head) 16× a layer, as a 128k vocabulary makes it: FSDP2 reshards it after forward and
    gathers it again at the start of backward (fp32: the peak), then reshards it before its gradients are
    reduce-scattered, freeing the embedding's gradient before the output shard is made (bf16: the peak).
    Rank 0 of 2 on the fake process group. Measured: exact (before: +23% and +7.3%, the root held throughout).
    One shard (world 1) gathers without a flat all-gather buffer and copies its reduce input into the output
    after every root gradient is freed: exact (before: +1.3% to +2.9%)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**read_config_dict(name="llama-tiny"), "vocab_size": 32768}))
    spec = resolve(path=config)
    recipe = Recipe(engine="fsdp", world=world, device="cpu", precision=precision, micro_batch=1, seq_len=32)
    assert forecast(spec, recipe).peak_allocated_bytes == pytest.approx(fake_step_peak(spec, recipe), rel=1e-3)


@pytest.mark.parametrize(
    ("model", "engine", "recompute"), [("llama-tiny", "deepspeed", "none"), ("llama3-8b", "fsdp", "full")]
)
def test_what_a_sharded_engine_gathers_or_reduces_at_the_peak_is_named_not_temporaries(model, engine, recompute):
    """ZeRO-3's head gather at the LM head, and FSDP2's root reduce-scatter input, are in their own parts."""
    spec = resolve(name=model)
    blocks = block_params(spec)
    recipe = Recipe(engine=engine, world=8, precision="bf16-mixed", micro_batch=1, seq_len=2048)
    result = forecast(spec, recipe.with_(recompute=(recompute,) * spec.layers))
    assert sum(result.breakdown.values()) == result.peak_allocated_bytes
    if engine == "deepspeed":  # llama-tiny is within the reuse distance: every layer stays gathered to the head
        assert "LM head" in result.phase
        assert result.breakdown["gathered_parameters"] == blocks.total * 2
    else:
        assert result.phase == "backward, micro-step 1, root reduce-scatter"
        assert result.breakdown["comm_buffers"] >= (blocks.pre + blocks.post) * 4


@pytest.mark.parametrize(("engine", "zero_stage"), [("torch", 1), ("fsdp", 1), ("deepspeed", 2), ("deepspeed", 3)])
def test_many_micro_steps_cost_no_more_time_than_five(engine, zero_stage):
    """Micro-steps 2 .. G-1 repeat; the forecast must not walk each (G = 10⁶ once took minutes)."""
    spec = resolve(name="llama-tiny")
    recipe = Recipe(engine=engine, zero_stage=zero_stage, world=2, device="cpu", micro_batch=2, seq_len=64)
    peaks = {g: forecast(spec, recipe.with_(grad_accum=g)).peak_allocated_bytes for g in (5, 6, 7)}
    started = time.perf_counter()
    many = forecast(spec, recipe.with_(grad_accum=10**6)).peak_allocated_bytes
    assert time.perf_counter() - started < 2
    assert peaks[7] - peaks[6] == peaks[6] - peaks[5]
    assert many == peaks[5] + (10**6 - 5) * (peaks[6] - peaks[5])


WORKER = os.path.join(os.path.dirname(__file__), "scripts", "engines_worker.py")
# --warmup 0 --steps 1: two steps, memory measured on step 2 as with --warmup 2 (the timed step 1 is not read)
SHAPE = "--micro-batch 2 --seq-len 128 --steps 1 --warmup 0 --device cpu"
SMALL = "--micro-batch 1 --seq-len 32 --grad-accum 2 --steps 1 --warmup 0 --device cpu"
STEP_BOUND = "--micro-batch 1 --seq-len 32 --steps 1 --warmup 0 --device cpu"  # activations smaller than the states
DISTRIBUTED = {
    "ddp": f"--model torch/llama-tiny --grad-accum 2 {SHAPE}",
    "fsdp": f"--model fsdp/llama-tiny --grad-accum 2 {SHAPE}",
    "zero3": f"--model deepspeed/llama-tiny {SHAPE}",
    "zero3-small": f"--model deepspeed/llama-tiny --zero-stage 3 {SMALL}",
    "zero2-small": f"--model deepspeed/llama-tiny --zero-stage 2 {SMALL}",
    "zero1-small": f"--model deepspeed/llama-tiny --zero-stage 1 {SMALL}",
    # bf16-mixed: FSDP2 and DeepSpeed compute with bf16 parameters and hold bf16 gradients
    "fsdp-bf16": f"--model fsdp/llama-tiny --precision bf16-mixed {SHAPE}",
    "fsdp-bf16-weights": f"--model fsdp/llama-tiny --precision bf16 --grad-accum 2 {SHAPE}",
    "zero3-bf16": f"--model deepspeed/llama-tiny --precision bf16-mixed {SHAPE}",
    "zero3-small-bf16": f"--model deepspeed/llama-tiny --zero-stage 3 --precision bf16-mixed {SMALL}",
    # bf16 with accumulation: ZeRO-1 keeps the bf16 .grad whole, ZeRO-2 a bf16 partition buffer
    "zero1-accum-bf16": f"--model deepspeed/llama-tiny --zero-stage 1 --precision bf16-mixed --grad-accum 2 {SHAPE}",
    "zero2-accum-bf16": f"--model deepspeed/llama-tiny --zero-stage 2 --precision bf16-mixed --grad-accum 2 {SHAPE}",
    # A user's DeepSpeed config in the regime of large models: max_live_parameters (about two layers) bounds
    # the prefetch and the reuse distance releases blocks after their forward.
    "zero3-window": f"--model deepspeed/llama-tiny --deepspeed-config {{window}} {SHAPE}",
    "zero3-window-small": f"--model deepspeed/llama-tiny --deepspeed-config {{window}} {SMALL}",
    # 12 layers with an 8B model's ratios: a bucket of a quarter layer, max-live of 3.3 layers, reuse distance
    # of an eighth of the model (blocks kept by the prefetch's reach, not by the reuse distance)
    "zero3-window-12l": f"--model-config {{deep}} --engine deepspeed --deepspeed-config {{window12}} {SHAPE}",
    # A user's reduce_bucket_size: ZeRO-1/2 allocate it whole at the first gradient of a step
    "zero2-bucket": f"--model deepspeed/llama-tiny --zero-stage 2 --deepspeed-config {{bucket2}} {SHAPE}",
    "zero1-bucket": f"--model deepspeed/llama-tiny --zero-stage 1 --deepspeed-config {{bucket1}} {SHAPE}",
    # overlap_comm: two IPG buffers, one reducing while the other fills
    "zero2-overlap": f"--model deepspeed/llama-tiny --zero-stage 2 --deepspeed-config {{overlap2}} {SHAPE}",
    "zero1-overlap": f"--model deepspeed/llama-tiny --zero-stage 1 --deepspeed-config {{overlap1}} {SHAPE}",
    # foreach AdamW (torch's pick on CUDA) steps the flat partition: its one copy is of that, not of the model;
    # then ZeRO-1's peak is the boundary's copy of the whole gradients into the partition
    "zero1-foreach": f"--model deepspeed/llama-tiny --zero-stage 1 --deepspeed-config {{foreach}} {STEP_BOUND}",
    "zero2-foreach": f"--model deepspeed/llama-tiny --zero-stage 2 --deepspeed-config {{foreach}} {STEP_BOUND}",
    # with accumulation ZeRO-2 makes a new gradient partition in micro-step 2 while the first is alive, in the
    # backward block where each rank's first bucket is reduced: the ranks' peaks differ
    "zero2-foreach-accum": f"--model deepspeed/llama-tiny --zero-stage 2 --deepspeed-config {{foreach}} {SMALL}",
    # a 32k vocabulary: the embedding fills rank 0's partition, and DeepSpeed's gradient norm copies that piece
    # in fp64, which sets the peak under foreach (as a 128k vocabulary does at 1B-8B)
    "zero2-foreach-vocab": f"--model-config {{vocab}} --engine deepspeed --zero-stage 2 --deepspeed-config {{foreach}} "
    f"{STEP_BOUND}",
    # bf16: at the norm ZeRO-1 holds its gradient partition in bf16, and makes the fp32 one for the step after
    "zero1-foreach-vocab-bf16": f"--model-config {{vocab}} --engine deepspeed --zero-stage 1 --precision bf16-mixed "
    f"--deepspeed-config {{foreach}} {STEP_BOUND}",
    # ZeRO-3 steps its partition one optimizer sub-group at a time (sub_group_size, 1e9 by default: llama3.2-1b
    # has two, and on an H200 the step's forecast was +6.7% with one); here 316k of each rank's 631k elements
    "zero3-foreach-subgroups": f"--model deepspeed/llama-tiny --precision bf16-mixed --deepspeed-config {{subgroups}} "
    f"{STEP_BOUND}",
}
# ZeRO-2's gradient partitions differ in size and in when they are made; ZeRO-1's boundary copies each rank's own
# partition (rank 1's, without the embedding, 525,824 bytes lower at b1 s32)
RANKS_DIFFER = {"zero2-foreach-accum", "zero1-foreach"}
FOREACH_CONFIG = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "foreach": True}}}
WINDOW_CONFIG = {
    "zero_optimization": {
        "stage": 3,
        "stage3_prefetch_bucket_size": 50_000,
        "stage3_max_live_parameters": 400_000,
        "stage3_max_reuse_distance": 0,
    }
}


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory):
    """One torchrun launch (2 CPU processes, gloo) running each engine through the benchmark; the records."""
    out = tmp_path_factory.mktemp("distributed")
    names = (
        "window",
        "window12",
        "deep",
        "vocab",
        "bucket1",
        "bucket2",
        "overlap1",
        "overlap2",
        "foreach",
        "subgroups",
    )
    paths = {name: out / f"{name}.config.json" for name in names}
    paths["window"].write_text(json.dumps(WINDOW_CONFIG))
    paths["foreach"].write_text(json.dumps(FOREACH_CONFIG))
    subgroups = {**WINDOW_CONFIG["zero_optimization"], "sub_group_size": 300_000}
    paths["subgroups"].write_text(json.dumps(FOREACH_CONFIG | {"zero_optimization": subgroups}))
    window12 = {"stage": 3, "stage3_prefetch_bucket_size": 46_000, "stage3_max_live_parameters": 600_000}
    paths["window12"].write_text(json.dumps({"zero_optimization": window12 | {"stage3_max_reuse_distance": 330_000}}))
    paths["deep"].write_text(json.dumps({**read_config_dict(name="llama-tiny"), "num_hidden_layers": 12}))
    paths["vocab"].write_text(json.dumps({**read_config_dict(name="llama-tiny"), "vocab_size": 32768}))
    for stage in (1, 2):
        bucket = {"stage": stage, "reduce_bucket_size": 2_000_000}
        paths[f"bucket{stage}"].write_text(json.dumps({"zero_optimization": bucket}))
        paths[f"overlap{stage}"].write_text(json.dumps({"zero_optimization": bucket | {"overlap_comm": True}}))
    specs = [f"{name}={args.format(**paths)}" for name, args in DISTRIBUTED.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", WORKER, str(out), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: json.loads((out / f"{name}.json").read_text())["results"] for name in DISTRIBUTED}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "tolerance"),
    # TOLERANCE (0.5%): every rank measured within it in two runs with the CPU count that no longer depends on
    # when gloo's thread frees its copies or the flattened buckets handed to it (2026-12-07).
    [
        ("ddp", TOLERANCE),  # -0.01%
        ("fsdp", TOLERANCE),  # -0.01%
        ("zero3", TOLERANCE),  # -0.01%
        ("zero3-small", TOLERANCE),  # -0.05% (peak in forward)
        # +0.32% twice (+0.32%, -0.43%, once +3.6% before gloo's late frees of the flattened buckets were taken back
        # to their last use)
        ("zero2-small", TOLERANCE),
        ("zero1-small", TOLERANCE),  # -0.00%
        ("fsdp-bf16", TOLERANCE),  # -0.01%
        ("fsdp-bf16-weights", TOLERANCE),  # -0.02% (bf16 shards, moments and reduce-scatter)
        ("zero3-bf16", TOLERANCE),  # -0.01%
        ("zero3-small-bf16", TOLERANCE),  # -0.00% (the step's fp32 copy of the bf16 gradient partition)
        # -0.02% and +0.12%; +10% and +5% when kept gradients were counted in fp32
        ("zero1-accum-bf16", TOLERANCE),
        ("zero2-accum-bf16", TOLERANCE),
        ("zero3-window", TOLERANCE),  # -0.19% (the head's backward)
        ("zero3-window-small", TOLERANCE),  # -0.00% (the optimizer step)
        ("zero3-window-12l", TOLERANCE),  # -0.06%
        # ZeRO-2 -0.01% (-1.27% with the 8 MB IPG bucket made after the head's backward, not at its first
        # gradient); ZeRO-1 -0.01% (-8.5% before the bucket was modelled)
        ("zero2-bucket", TOLERANCE),
        ("zero1-bucket", TOLERANCE),
        # -0.00% each (ZeRO-2 -1.02% as zero2-bucket; ZeRO-1 +1.57% with its whole gradients held to the end:
        # with overlap_comm it reduces in the boundary's backward as ZeRO-2 does)
        ("zero2-overlap", TOLERANCE),
        ("zero1-overlap", TOLERANCE),
        # ZeRO-1: the highest rank (0) -0.32% in every run; ZeRO-2 -0.00% and +0.37% twice (-3.38% on rank 0 once
        # with a flattened bucket freed late by gloo's thread); they were +12% and +28% with the model's parameters
        # as foreach's copy, ZeRO-1 -13% without the partition copy.
        ("zero1-foreach", TOLERANCE),
        ("zero2-foreach", TOLERANCE),
        # The highest rank's peak: -0.09% twice (rank 1, its partition made in the LM head's backward; rank 0 makes
        # its own at the embedding, +6.3%); -0.41% and once -1.43% (a flattened bucket gloo's thread freed late)
        # with the IPG bucket made after the head's backward; -11.4% with one partition of a shard's size.
        ("zero2-foreach-accum", TOLERANCE),
        ("zero2-foreach-vocab", TOLERANCE),  # +0.05% (the fp64 norm copy of the embedding's gradient); -10.7% without
        ("zero1-foreach-vocab-bf16", TOLERANCE),  # -0.03%; +7.9% with the fp32 partition held at the norm
        ("zero3-foreach-subgroups", TOLERANCE),  # -0.00%; +19.9% with the whole partition stepped at once
    ],
)
def test_forecast_of_two_processes_per_rank(distributed_runs, engine, tolerance):
    """The forecast the benchmark records vs its measured per-rank peak (DDP's buckets, FSDP2's gathers, ZeRO's
    flat partitions and prefetch buckets), on every rank."""
    results = distributed_runs[engine]
    predicted = results["forecast"]["peak_allocated_bytes"]
    per_rank = results["peak_allocated_bytes_per_rank"]
    # Where ranks hold different states by design the forecast is the highest rank's; elsewhere every rank's.
    for measured in [max(per_rank)] if engine in RANKS_DIFFER else per_rank:
        assert abs(predicted - measured) / measured < tolerance, (predicted, per_rank)


@pytest.mark.slow
def test_fsdp2_on_one_process_is_forecast_without_a_collectives_copy(tmp_path):
    """One shard: FSDP2 runs no reduce-scatter (it copies the input to the output), so gloo copies nothing; the
    forecast counted gloo's copy of the root's gradients, +10.4% at this shape, then +1.3% with the flat all-gather
    buffers that one shard does not make and the head's gradient it frees before its copy. Measured: -0.00%."""
    out = tmp_path / "one.json"
    argv = ["--model", "fsdp/llama-tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1", "--device", "cpu"]
    proc = run_ljperf("benchmark", *argv, "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_record(out)["results"]
    predicted, (measured,) = results["forecast"]["peak_allocated_bytes"], results["peak_allocated_bytes_per_rank"]
    assert abs(predicted - measured) / measured < TOLERANCE, (predicted, measured, results["forecast"]["phase"])


@pytest.mark.slow
def test_plan_reads_the_deepspeed_config_the_benchmark_ran(distributed_runs, tmp_path, capsys):
    """``ljperf plan --deepspeed-config`` forecasts what the benchmark forecast (and measured) with that config."""
    path = tmp_path / "window.json"
    path.write_text(json.dumps(WINDOW_CONFIG))
    argv = ["plan", "--model", "deepspeed/llama-tiny", "--device", "cpu", "--gpus", "2", "--micro-batch", "2"]
    argv += ["--seq-len", "128", "--gpu-memory", "1GiB", "--json"]
    assert main([*argv, "--deepspeed-config", str(path)]) == 0
    with_config = json.loads(capsys.readouterr().out)["peak_allocated_bytes"]
    assert main(argv) == 0
    default = json.loads(capsys.readouterr().out)["peak_allocated_bytes"]
    assert with_config == distributed_runs["zero3-window"]["forecast"]["peak_allocated_bytes"]
    assert default == distributed_runs["zero3"]["forecast"]["peak_allocated_bytes"]
    assert with_config < default  # blocks released after their forward
    # ... and its optimizer's foreach, as the benchmark's own forecast read it
    path.write_text(json.dumps(FOREACH_CONFIG))
    small = ["--zero-stage", "2", "--micro-batch", "1", "--seq-len", "32", "--deepspeed-config", str(path)]
    assert main([*argv[:7], *small, "--gpu-memory", "1GiB", "--json"]) == 0
    foreach = json.loads(capsys.readouterr().out)["peak_allocated_bytes"]
    assert foreach == distributed_runs["zero2-foreach"]["forecast"]["peak_allocated_bytes"]


def test_zero_settings_ipg_buffers_follow_overlap_comm_and_contiguous_gradients():
    """ZeRO-1/2's ``setup_buckets``: one IPG buffer, two with ``overlap_comm``, none without contiguous gradients
    (measured on CPU, 2 processes, 2e6-element bucket: -0.0% for both stages without contiguous gradients)."""
    settings = {
        (overlap, contiguous): ZeroSettings.from_config(
            {
                "zero_optimization": {
                    "overlap_comm": overlap,
                    "contiguous_gradients": contiguous,
                    "reduce_bucket_size": 2e6,
                }
            }
        )
        for overlap in (False, True)
        for contiguous in (False, True)
    }
    assert {key: value.ipg_buffers() for key, value in settings.items()} == {
        (False, False): 0,
        (True, False): 0,
        (False, True): 1,
        (True, True): 2,
    }
    spec = resolve(name="llama-tiny")
    recipe = Recipe(
        engine="deepspeed", zero_stage=2, world=2, device="cpu", precision="fp32", micro_batch=2, seq_len=128
    )
    none, one, two = (
        forecast(spec, recipe.with_(zero=settings[key])).peak_allocated_bytes
        for key in ((False, False), (False, True), (True, True))
    )
    assert two - one == 2_000_000 * 4  # a second fp32 buffer: the peak is in the layers' backward, buffers alive
    assert one > none  # without buffers the peak moves to the head's backward


def test_plan_says_offload_is_not_modelled(tmp_path, capsys):
    path = tmp_path / "offload.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    argv = ["plan", "--model", "deepspeed/llama-tiny", "--device", "cpu", "--gpus", "2", "--json"]
    assert main([*argv, "--deepspeed-config", str(path)]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("offload_optimizer not modelled" in note for note in notes), notes
    assert main(argv) == 0
    assert not any("offload" in note for note in json.loads(capsys.readouterr().out)["notes"])
