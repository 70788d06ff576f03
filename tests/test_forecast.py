"""Memory forecast vs real CPU training steps (the benchmark's own live-tensor measurement), and ``ljperf plan``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import ljperf.forecast.blocks
from ljperf.benchmark import fakestep
from ljperf.benchmark.fakestep import fake_step_peak
from ljperf.benchmark.loop import measured_memory_step
from ljperf.benchmark.record import LoopState
from ljperf.cli import main
from ljperf.core.options import OptimConfig, TrainConfig
from ljperf.core.plans import fixed_plan, parse_recompute
from ljperf.engines.torch_engine import TorchEngine
from ljperf.forecast import Recipe, analytic, calibrate, forecast, layer_costs, patches, sharding, trace, walk
from ljperf.forecast.blocks import block_params
from ljperf.forecast.recipe import ZeroSettings
from ljperf.forecast.trace import LiveBytesTimeline, fake_model
from ljperf.models.catalog import read_config_dict, split_model_arg
from ljperf.models.spec import ModelSpec, build_meta, resolve, with_layers
from ljperf.run.config import RunConfig, fixed_recompute
from ljperf.run.context import RunContext

from conftest import MOE


def measured_peak(
    name: str | ModelSpec,
    *,
    micro_batch: int,
    seq_len: int,
    recompute: str,
    precision: str = "fp32",
    attn: str = "sdpa",
) -> int:
    """Peak live bytes of step 2 of a real torch-engine run, measured as ``ljperf benchmark`` does."""
    spec = resolve(name=name) if isinstance(name, str) else name
    train = TrainConfig(micro_batch=micro_batch, seq_len=seq_len, precision=precision, device="cpu", warmup=1, steps=1)
    cfg = RunConfig(engine="torch", model=spec, train=train, optim=OptimConfig(recompute=recompute))
    run = RunContext(config=cfg, plan=fixed_recompute(cfg))
    engine = TorchEngine(run)
    engine.setup(build_meta(spec, attn_implementation=attn))
    tokens = [torch.randint(0, spec.vocab, (micro_batch, seq_len))]
    engine.train_step(tokens)
    state = LoopState()
    measured_memory_step(run, engine, tokens, state=state)
    return state.peak_allocated


CONFIGS = [
    (name, recompute, b, s)
    for name in ("llama-tiny", "qwen3-tiny", "mistral-tiny")
    for recompute in ("none", "full")
    for b, s in ((2, 64), (3, 160))
] + [
    ("llama-tiny", "none", 1, 256),
    ("llama-tiny", "full,none,full,none", 2, 128),
    ("llama-tiny", "selective,selective,none,full", 2, 128),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "recompute", "micro_batch", "seq_len"), CONFIGS)
def test_forecast_within_5_percent_of_a_real_step(name, recompute, micro_batch, seq_len):
    spec = resolve(name=name)
    modes = tuple(recompute.split(",")) if "," in recompute else (recompute,) * spec.layers
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=micro_batch, seq_len=seq_len, recompute=modes)
    predicted = forecast(spec, recipe).peak_allocated_bytes
    measured = measured_peak(name, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute)
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_bf16_weights_forecast_within_5_percent_of_a_real_step(name, recompute):
    """``--precision bf16``: bf16 weights, gradients and AdamW moments under autocast (a model loaded in bfloat16),
    half of bf16-mixed's model states. Measured: exact."""
    spec = resolve(name=name)
    recipe = Recipe(device="cpu", precision="bf16", micro_batch=2, seq_len=128, recompute=(recompute,) * spec.layers)
    predicted = forecast(spec, recipe).peak_allocated_bytes
    measured = measured_peak(name, micro_batch=2, seq_len=128, recompute=recompute, precision="bf16")
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)
    mixed = forecast(spec, Recipe(device="cpu", precision="bf16-mixed", micro_batch=2, seq_len=128))
    assert predicted < mixed.peak_allocated_bytes


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
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_fsdp2_root_regathered_in_backward_and_resharded_before_its_reduce(precision, tmp_path):
    """A root (embedding, head) 16× a layer, as a 128k vocabulary makes it: FSDP2 reshards it after forward and
    gathers it again at the start of backward (fp32: the peak), then reshards it before its gradients are
    reduce-scattered, freeing the embedding's gradient before the output shard is made (bf16: the peak).
    Rank 0 of 2 on the fake process group. Measured: exact (before: +23% and +7.3%, the root held throughout)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**read_config_dict(name="llama-tiny"), "vocab_size": 32768}))
    spec = resolve(path=config)
    recipe = Recipe(engine="fsdp", world=2, device="cpu", precision=precision, micro_batch=1, seq_len=32)
    assert forecast(spec, recipe).peak_allocated_bytes == pytest.approx(fake_step_peak(spec, recipe), rel=1e-3)


def test_a_model_shallower_than_the_trace_is_forecast(tmp_path):
    """The trace runs 3- and 4-layer copies. A 2-layer config (a user's CI model) whose per-layer
    ``layer_types`` list has 2 entries made transformers fail on the third layer (IndexError, a traceback)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**read_config_dict(name="qwen3-tiny"), "num_hidden_layers": 2}))
    spec = resolve(path=config)
    assert len(spec.config.layer_types) == 2  # transformers fills it in from the layer count
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64)
    predicted = forecast(spec, recipe).peak_allocated_bytes
    measured = measured_peak(spec, micro_batch=2, seq_len=64, recompute="none")
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


LLAMA_LAYOUT = ["gemma2", "gemma3_text", "phi3", "gpt_neox", "olmo2", "starcoder2", "cohere", "opt"]
# transformer.h; Falcon's and BLOOM's layers return tuples; GPT-2's SDPA has dropout (0.1), its CPU math path
GPT2_LAYOUT = ["gpt2", "falcon", "bloom", "gptj", "gpt_bigcode"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "recompute"),
    [(m, "none") for m in LLAMA_LAYOUT + GPT2_LAYOUT + list(MOE)]
    + [("falcon", "full"), ("bloom", "selective"), ("gpt2", "1"), ("mixtral", "full"), ("qwen2_moe", "selective")],
)
def test_forecast_of_other_architectures_within_5_percent(model_type, recompute, tmp_path):
    """Configs beyond the catalog's Llama, Qwen and Mistral, as a user's --model-config gives them: transformers'
    defaults at a tiny size (Gemma 2 runs eager: its class has no SDPA)."""
    from transformers import AutoConfig

    size = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1024}
    size["max_position_embeddings"] = 512
    if model_type in LLAMA_LAYOUT or model_type in MOE:
        size |= {"intermediate_size": 256, "num_key_value_heads": 2, "head_dim": 32} | MOE.get(model_type, {})
    if model_type == "gptj":
        size["rotary_dim"] = 16  # its default, 64, is wider than a head here
    config = AutoConfig.for_model(model_type, **size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    spec = resolve(path=path)
    attn = spec.attention(None)
    recipe = Recipe(
        device="cpu",
        precision="fp32",
        micro_batch=2,
        seq_len=64,
        attn_implementation=attn,
        recompute=fixed_plan(parse_recompute(recompute), spec.layers),
    )
    result = forecast(spec, recipe)
    measured = measured_peak(spec, micro_batch=2, seq_len=64, recompute=recompute, attn=attn)
    assert result.source == "traced"
    assert abs(result.peak_allocated_bytes - measured) / measured < 0.05, (result.peak_allocated_bytes, measured)


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_the_older_transformers_experts_stand_in_traces_what_transformers_runs(mode, tmp_path, monkeypatch):
    """transformers 5.17 (the GPU machine's) has no backward op for its fp32 grouped_mm fallback, and its Python
    backward reads the offsets' values, which fake tensors lack: every MoE forecast was analytic there. The
    trace's stand-in, run here by hiding 5.24's backward op, keeps what transformers' own op keeps, with and
    without selective recompute (which keeps the op's output): the same peak in every block of the timeline
    (the test above checks it against a real step under 5.17)."""
    from transformers import AutoConfig
    from transformers.integrations import moe

    from ljperf.forecast.trace import RawTrace, trace_shape

    size = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1024}
    size |= {"intermediate_size": 256, "num_key_value_heads": 2, "head_dim": 32} | MOE["mixtral"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(AutoConfig.for_model("mixtral", **size).to_dict()))
    spec = resolve(path=path)
    shape = {"micro_batch": 2, "seq_len": 64, "precision": "fp32", "attn": "sdpa", "mode": mode, "layers": 3}
    ops = trace_shape(spec, **shape)
    monkeypatch.delattr(moe, "_grouped_mm_fallback_bwd", raising=False)  # 5.17 has none
    calls, apply = [], patches.FallbackGroupedMM.apply
    monkeypatch.setattr(patches.FallbackGroupedMM, "apply", lambda *args: calls.append(1) or apply(*args))
    stand_in = trace_shape(spec, **shape)
    assert len(calls) == 2 * 3 * 2 * (2 if mode == "selective" else 1)  # gate-up and down, 3 layers, 2 micro-steps

    def block_peaks(trace: RawTrace) -> list[tuple[str, int]]:
        ends = [i for _, i in trace.marks[1:]] + [len(trace.points)]
        return [(name, max(trace.points[i:end])) for (name, i), end in zip(trace.marks, ends, strict=True)]

    assert block_peaks(stand_in) == block_peaks(ops)


GPT2_TINY = {"model_type": "gpt2", "n_embd": 128, "n_layer": 4, "n_head": 4, "vocab_size": 1024, "n_positions": 256}


def test_a_cuda_trace_runs_in_fp32_what_cuda_autocast_runs_in_fp32():
    """``trace.CUDA_FP32`` against torch's own autocast policies, on fake tensors: CUDA's autocast (fake CUDA tensors
    need no GPU) returns fp32 for each, CPU's returns bf16, and the CUDA trace's stand-in returns fp32; ops
    outside CUDA's fp32 list, or given a dtype, are left alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    f = torch.nn.functional
    fp32 = {
        "pow": lambda x: torch.pow(x, 3.0), "Tensor.pow": lambda x: x.pow(2), "**": lambda x: x**2,
        "rpow": lambda x: 2**x, "exp": torch.exp, "log": torch.Tensor.log, "rsqrt": torch.rsqrt,
        "reciprocal": torch.reciprocal, "layer_norm": lambda x: f.layer_norm(x, (8,)),
        "group_norm": lambda x: f.group_norm(x, 2), "softplus": f.softplus, "softmax": lambda x: torch.softmax(x, -1),
        "F.softmax": lambda x: f.softmax(x, dim=-1), "log_softmax": lambda x: f.log_softmax(x, -1),
        "sum": torch.Tensor.sum, "cumsum": lambda x: torch.cumsum(x, 0),
    }  # fmt: skip
    kept = {
        "tanh": torch.tanh,
        "gelu": f.gelu,
        "silu": f.silu,
        "F.softmax(dtype)": lambda x: f.softmax(x, -1, dtype=x.dtype),
    }

    def dtypes(op) -> tuple[torch.dtype, ...]:
        with FakeTensorMode():
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", torch.bfloat16)
            torch.autocast_increment_nesting()
            try:
                cuda = op(torch.empty(4, 8, device="cuda", dtype=torch.bfloat16)).dtype
            finally:
                torch.autocast_decrement_nesting()
                torch.set_autocast_enabled("cuda", False)
                torch.clear_autocast_cache()
            x = torch.empty(4, 8, dtype=torch.bfloat16)
            state = {"cuda_differs": False}
            with torch.autocast("cpu", dtype=torch.bfloat16):
                cpu = op(x).dtype
                with trace.CudaAutocastFp32(state, cast=True):
                    emulated = op(x).dtype
            return cuda, cpu, emulated, state["cuda_differs"]

    for name, op in fp32.items():
        assert dtypes(op) == (torch.float32, torch.bfloat16, torch.float32, True), name
    for name, op in kept.items():
        assert dtypes(op) == (torch.bfloat16, torch.bfloat16, torch.bfloat16, False), name


def test_a_cuda_forecast_keeps_the_fp32_copies_of_gpt2s_gelu(tmp_path):
    """GPT-2's tanh GELU cubes its input: CUDA's autocast runs that pow in fp32, so the fp32 copy of the input
    is saved, and the rest of the GELU (tanh, its sum) runs and is saved in fp32: 24 bytes per token and hidden
    unit more than CPU's bf16 (4h wide: 2 more for the copy, 2 each for the two). On the H200 (2026-12-04,
    torch engine, bf16-mixed) GPT-2 large at 4 × 1024 measured 27.74 GiB against 23.76 forecast (-14.3%);
    with this +0.9% (1 × 1024: -2.2%, now -1.4%). The erf GELU has no such op: its forecasts are equal."""
    tokens = 2 * 256
    recipes = {d: Recipe(device=d, precision="bf16-mixed", micro_batch=2, seq_len=256) for d in ("cpu", "cuda")}
    extra = {}
    for act in ("gelu_new", "gelu"):
        path = tmp_path / f"{act}.json"
        path.write_text(json.dumps(GPT2_TINY | {"attn_pdrop": 0.0, "activation_function": act}))
        spec = resolve(path=path)
        acts = {d: forecast(spec, r).breakdown["activations"] for d, r in recipes.items()}
        extra[act] = acts["cuda"] - acts["cpu"]
    assert extra == {"gelu_new": GPT2_TINY["n_layer"] * tokens * 24 * GPT2_TINY["n_embd"], "gelu": 0}


def test_a_cuda_forecast_of_fp32_grouped_query_attention_keeps_the_math_paths_probabilities():
    """CUDA's flash kernel takes bf16 only and its memory-efficient one no grouped K/V heads, so fp32 training of a
    GQA model runs SDPA's math path on CUDA (b·h·s² fp32 probabilities kept), while CPU's flash kernel takes it.
    On the H200 (2026-12-04) the startup hook's HF Trainer script (a 6-layer GQA Llama, fp32, 64 × 256 tokens)
    measured 624.71 MiB against 395.14 forecast (-36.7%, which its closed loop corrected); this forecasts 594.39
    (-4.9%). Under bf16 autocast SDPA gets bf16 inputs on CUDA too, flash runs, and CUDA's forecast is CPU's."""
    spec = resolve(name="llama-tiny")
    assert spec.config.num_key_value_heads < spec.config.num_attention_heads
    b, s, heads = 2, 128, spec.config.num_attention_heads
    activations = {}
    for precision in ("fp32", "bf16-mixed"):
        for device in ("cpu", "cuda"):
            recipe = Recipe(device=device, precision=precision, micro_batch=b, seq_len=s)
            activations[precision, device] = forecast(spec, recipe).breakdown["activations"]
    probabilities = spec.layers * b * heads * s * s * 4
    assert activations["fp32", "cuda"] - activations["fp32", "cpu"] >= probabilities, activations
    assert activations["bf16-mixed", "cuda"] == activations["bf16-mixed", "cpu"]


def test_a_cuda_forecast_keeps_what_fused_attention_dropout_keeps(tmp_path):
    """CPU SDPA with dropout keeps the b·h·s² probabilities and mask (its math path: the CPU test above measures
    it); CUDA's flash/efficient kernels fuse the dropout, so GPT-2 on CUDA keeps what it keeps without attention
    dropout (GPT-2 XL, 2 × 1024 tokens: 41.2 GiB of activations were forecast, 12.2 now)."""
    recipes = {d: Recipe(device=d, precision="bf16-mixed", micro_batch=2, seq_len=256) for d in ("cpu", "cuda")}
    out = {}
    for attn_pdrop in (0.1, 0.0):
        path = tmp_path / f"gpt2-{attn_pdrop}.json"
        # erf GELU: GPT-2's own (tanh) runs otherwise on CUDA too (the test below)
        config = GPT2_TINY | {"activation_function": "gelu"}
        path.write_text(json.dumps(config | {"attn_pdrop": attn_pdrop}))
        spec = resolve(path=path)
        out[attn_pdrop] = {d: forecast(spec, r) for d, r in recipes.items()}
    assert out[0.1]["cuda"].peak_allocated_bytes == out[0.0]["cuda"].peak_allocated_bytes
    activations = {key: {d: f.breakdown["activations"] for d, f in by.items()} for key, by in out.items()}
    assert activations[0.1]["cuda"] == activations[0.0]["cuda"] == activations[0.0]["cpu"]
    probabilities = 4 * 4 * 2 * 256 * 256 * 2  # the 4 layers' bf16 attention probabilities, at least
    assert activations[0.1]["cpu"] > activations[0.1]["cuda"] + probabilities, activations


def test_layers_of_different_sizes_are_counted_each(tmp_path):
    """DeepSeek-V3 at its real size: three dense layers, then 58 of 256 experts. The blocks were one layer's
    numbers times 61, the first (dense) layer's: 0.54 GiB of parameters per rank of 256 under FSDP2, not 9.8."""
    from transformers import AutoConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(AutoConfig.for_model("deepseek_v3").to_dict()))
    spec = resolve(path=path)
    blocks = block_params(spec)
    assert blocks.total == spec.params.total and len(set(blocks.layer_sizes[:3])) == 1
    assert blocks.layer_sizes[3] > 10 * blocks.layer_sizes[0] and len(set(blocks.layer_sizes[3:])) == 1
    fsdp = sharding.engine_sharding(spec, Recipe(engine="fsdp", world=256, precision="bf16-mixed"))
    assert fsdp.params == -(-blocks.total * 4 // 256)  # 9.77 GiB


DEEPSEEK_TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
DEEPSEEK_TINY |= {"vocab_size": 1024, "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1}
DEEPSEEK_TINY |= {"eos_token_id": 2} | MOE["deepseek_v3"] | {"first_k_dense_replace": 3, "num_hidden_layers": 5}


def test_layers_of_different_kinds_are_traced_each(tmp_path):
    """DeepSeek-V3's layout at 5 layers: three dense, then two of experts (micro batch 1: its family traces 4
    shapes, not 7). Copies of 3 and 4 layers had only
    dense ones (the trace failed, analytic: -17%); now one copy per kind of middle layer, made of the full
    model's own layers (0, 1, 4) and (0, 3, 4), and the walk takes each layer's own kind."""
    from transformers import AutoConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(AutoConfig.for_model("deepseek_v3", **DEEPSEEK_TINY).to_dict()))
    spec = resolve(path=path)
    assert block_params(spec).layer_kinds == (0, 0, 0, 1, 1)
    # the first two layers full, the rest none: both modes, both kinds (selective, none alone: exact by hand)
    plan = fixed_plan(parse_recompute("2"), spec.layers)
    result = forecast(spec, Recipe(device="cpu", precision="fp32", micro_batch=1, seq_len=64, recompute=plan))
    measured = measured_peak(spec, micro_batch=1, seq_len=64, recompute="2")
    assert result.source == "traced"
    assert abs(result.peak_allocated_bytes - measured) / measured < 0.05, (result, measured)


def test_picks_of_layer_kinds():
    assert trace.layer_picks((0,) * 4) == {0: None}
    assert trace.layer_picks((0, 0, 0, 1, 1, 1)) == {0: (0, 1, 5), 1: (0, 3, 5)}
    assert trace.layer_picks((0, 1, 0, 1)) == {1: (0, 1, 3), 0: (0, 2, 3)}  # Llama 4 Maverick's interleaving
    assert trace.layer_picks((0, 1)) == {1: (0, 1, 1)}  # no middle layer: the last stands in
    assert trace.reference_kind((0, 0, 0, 1, 1, 1, 1)) == 1 and trace.reference_kind((0, 1)) == 1


def test_the_recompute_cost_per_layer_is_a_layer_of_the_most_frequent_kind(tmp_path):
    """The solver ranks plans by one layer's recompute time: DeepSeek-V3's is a layer of experts (58 of 61),
    not its first, dense, layer (what a one-layer copy builds). Its trace of fp32 experts failed (torch's fake
    grouped_mm takes bf16 only): ``--recompute auto`` of any mixture of experts ended in a traceback."""
    from transformers import AutoConfig

    from ljperf.recompute.cost import RecomputeCost, layer_cost

    def cost(dense: int) -> RecomputeCost:
        path = tmp_path / f"dense{dense}.json"
        config = AutoConfig.for_model("deepseek_v3", **DEEPSEEK_TINY | {"num_hidden_layers": 4})
        config.first_k_dense_replace = dense
        path.write_text(json.dumps(config.to_dict()))
        return layer_cost(resolve(path=path), micro_batch=1, seq_len=32, attn="sdpa")

    one_dense, all_experts, all_dense = cost(1), cost(0), cost(4)
    assert one_dense == all_experts and all_experts.saved_flops != all_dense.saved_flops


def test_a_cuda_forecast_keeps_what_fused_attention_keeps_for_a_narrower_value_head(tmp_path):
    """DeepSeek-V3's MLA: value heads (128) narrower than query heads (192). CPU SDPA runs its math path and
    keeps b·h·s² probabilities; CUDA's memory-efficient kernel does not (DeepSeek-V3 at 4096 tokens under
    FSDP2: 664.7 GiB of activations were forecast, 162.3 now). So the CUDA forecast is linear in s."""
    from transformers import AutoConfig

    mla = {"v_head_dim": 16, "num_hidden_layers": 3, "first_k_dense_replace": 1}
    config = AutoConfig.for_model("deepseek_v3", **DEEPSEEK_TINY | mla)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    spec = resolve(path=path)

    def activations(device: str, s: int) -> int:
        recipe = Recipe(device=device, precision="bf16-mixed", micro_batch=1, seq_len=s)
        return forecast(spec, recipe).breakdown["activations"]

    cuda, cpu = ([activations(d, s) for s in (1024, 2048, 3072)] for d in ("cuda", "cpu"))
    assert cuda[2] - cuda[1] == cuda[1] - cuda[0]
    assert cpu[2] - cpu[1] > cpu[1] - cpu[0] + 4 * 1024 * 1024  # the s² term: 4 heads, at least a byte each


def test_per_layer_config_lists_follow_the_layer_count():
    spec = resolve(name="qwen3-tiny")
    spec.config.layer_types = ["sliding_attention", "full_attention"] * 2
    spec.config.mlp_only_layers = [1, 3]
    spec.config.moe_layers = [0, 2]  # Llama 4's list (a 2-layer Llama 4 traced its third layer dense: -15%)
    deeper, shallower = with_layers(spec, 5).config, with_layers(spec, 2).config
    assert deeper.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert (shallower.layer_types, shallower.mlp_only_layers, deeper.mlp_only_layers) == (
        ["sliding_attention", "full_attention"],
        [1],
        [1, 3],
    )
    assert (shallower.moe_layers, deeper.moe_layers) == ([0], [0, 2, 4])
    # DeepSeek's dense layers before its experts: an all-dense 3-layer model traced its 4-layer copy with a fourth
    # layer of experts (its trace failed, depth-dependent; analytic -12% on CPU)
    spec.config.first_k_dense_replace = 4  # all four layers dense
    assert [with_layers(spec, n).config.first_k_dense_replace for n in (2, 3, 5)] == [2, 3, 5]
    spec.config.first_k_dense_replace = 3
    five = with_layers(spec, 5)  # the full model's layers 0, 1, 2, 3, 0: three dense, then experts
    assert five.config.first_k_dense_replace == 3
    assert with_layers(five, 3, pick=(0, 3, 4)).config.first_k_dense_replace == 1


def test_a_sliding_window_the_trace_does_not_reach_gets_a_note(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**read_config_dict(name="mistral-tiny"), "sliding_window": 512}))
    args = ["plan", "--model-config", str(config), "--device", "cpu", "--precision", "fp32", "--json"]
    assert main([*args, "--seq-len", "1024"]) == 0
    (note,) = [n for n in json.loads(capsys.readouterr().out)["notes"] if "sliding window" in n]
    assert note.startswith("sliding window 512 is shorter than --seq-len 1024 but longer than the traced 128")
    assert main([*args, "--seq-len", "512"]) == 0
    assert not [n for n in json.loads(capsys.readouterr().out)["notes"] if "sliding window" in n]


def test_a_model_whose_step_fails_on_fake_tensors_gets_the_analytic_forecast_and_moe_a_note(tmp_path, capsys):
    """A 4-expert Mixtral whose experts loop over the tokens each one got (``experts_implementation: eager``):
    ``nonzero`` has no shape on fake tensors (it was a traceback, exit 1). transformers' default, ``grouped_mm``,
    is traced (``test_forecast_of_other_architectures_within_5_percent``)."""
    config = tmp_path / "config.json"
    mixtral = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4}
    tiny = {k: v for k, v in read_config_dict(name="llama-tiny").items() if k not in mixtral}
    config.write_text(json.dumps(tiny | mixtral | {"num_experts_per_tok": 2, "experts_implementation": "eager"}))
    args = ["plan", "--model-config", str(config), "--device", "cpu", "--precision", "fp32", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert record["source"] == "analytic" and "does not run on fake tensors: DynamicOutputShape" in record["notes"][0]
    assert any(note.startswith("mixture of 4 experts") for note in record["notes"])
    assert "Traceback" not in err


def test_breakdown_adds_up_and_recompute_saves_activations():
    spec = resolve(name="llama-tiny")
    none = forecast(spec, Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64))
    full = forecast(spec, Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64, recompute=("full",) * 4))
    assert sum(none.breakdown.values()) == none.peak_allocated_bytes
    assert full.peak_allocated_bytes < none.peak_allocated_bytes
    costs = layer_costs(spec, Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64))
    assert costs["full"].saved_bytes < costs["none"].saved_bytes
    # Full recompute keeps the layer input (fp32 hidden state) and nothing else.
    assert costs["full"].saved_bytes == 2 * 64 * spec.hidden * 4


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


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
@pytest.mark.parametrize(("engine", "precision"), [("torch", "fp32"), ("torch", "bf16-mixed"), ("fsdp", "bf16-mixed")])
def test_analytic_formula_cross_checks_the_trace(engine, precision, name, attn):
    """DDP's bf16 runs fp32 parameters under autocast; FSDP2 and DeepSpeed compute with bf16 parameters; qwen3
    normalises Q and K. Measured: exact, except DDP bf16 (−2.0% to −3.1%: one bf16 hidden-wide tensor per token
    the formula does not name)."""
    spec = resolve(name=name)
    recipe = Recipe(
        engine=engine, device="cpu", precision=precision, micro_batch=2, seq_len=128, attn_implementation=attn
    )
    traced = layer_costs(spec, recipe, modes=("none",))["none"].saved_bytes
    formula = analytic.layer_bytes(spec, recipe, "none")
    assert abs(formula - traced) / traced < 0.04, (formula, traced)


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_temporaries_match_a_traced_adamw_step(foreach):
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = resolve(name="llama-tiny")
    fake_mode = FakeTensorMode()
    model = fake_model(spec, attn="sdpa", fake_mode=fake_mode)
    tracker = LiveBytesTimeline()
    with fake_mode:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # creates the states
        for t in [*model.parameters(), *(p.grad for p in model.parameters())]:
            tracker.track(t)
        for state in opt.state.values():
            for v in state.values():
                tracker.track(v)
        before = tracker.current
        with tracker:
            opt.step()
    blocks = block_params(spec)
    recipe = Recipe(device="cpu", optimizer="foreach" if foreach else "single")
    expected = walk.optimizer_transient(blocks, recipe, local_params=blocks.total * 4)
    assert max(tracker.points) - before == pytest.approx(expected, rel=1e-3)


def test_a_damaged_cache_file_is_made_again(tmp_path, monkeypatch):
    """Cache files edited or cut short outside ljperf are traced again, not a KeyError in every plan."""
    from ljperf.forecast import trace

    monkeypatch.setenv("LJPERF_CACHE_DIR", str(tmp_path))
    spec, recipe = resolve(name="llama-tiny"), Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64)
    peaks = []
    for _ in range(2):
        monkeypatch.setattr(ljperf.forecast.blocks, "_BLOCKS", {})
        monkeypatch.setattr(trace, "_PATTERNS", {})
        peaks.append(forecast(spec, recipe).peak_allocated_bytes)
        files = list((tmp_path / "forecast").glob("*.json"))
        assert len(files) == 2  # the block counts and one family's patterns
        for path in files:
            path.write_text('{"pre": "x", "segments": 1}')
    assert peaks[0] == peaks[1]


def test_cached_forecast_builds_no_model(monkeypatch):
    """Once traced, a forecast is config arithmetic over the cached coefficients (what keeps ljperf plan fast)."""
    from ljperf.forecast import trace

    spec = resolve(name="qwen3-tiny")
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64, recompute=("full",) * spec.layers)
    first = forecast(spec, recipe)
    monkeypatch.setattr(ljperf.forecast.blocks, "_BLOCKS", {})
    monkeypatch.setattr(trace, "_PATTERNS", {})

    def no_build(*args, **kwargs):
        raise AssertionError("a cached forecast built a model")

    for module, name in ((ljperf.forecast.blocks, "build_meta"), (trace, "build_meta"), (trace, "build_picked")):
        monkeypatch.setattr(module, name, no_build)
    assert forecast(spec, recipe.with_(seq_len=4096)).peak_allocated_bytes > first.peak_allocated_bytes
    assert forecast(spec, recipe) == first


def test_plan_json_fits_and_max_micro_batch(capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--micro-batch", "2", "--seq-len", "64"]
    assert main([*argv, "--gpu-memory", "40MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "breakdown", "fits", "max_micro_batch"):
        assert key in out
    assert out["fits"] is (out["peak_allocated_bytes"] <= 40 * 1024**2)
    spec = resolve(name="llama-tiny")
    best = out["max_micro_batch"]
    assert best >= 1
    recipe = Recipe(device="cpu", precision="fp32", seq_len=64)
    assert forecast(spec, recipe.with_(micro_batch=best)).device_bytes <= 40 * 1024**2
    assert forecast(spec, recipe.with_(micro_batch=best + 1)).device_bytes > 40 * 1024**2


def test_plan_with_gpu_memory_applies_the_saved_calibration(own_calibration, capsys):
    """``--gpu-memory`` sizes the device; the overheads are still this machine's calibration (``cpu`` here)."""
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "64", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["peak_allocated_bytes"]
    own_calibration.write_text(json.dumps({"version": 1, "devices": {"cpu": {"scale": 1.25, "samples": 3}}}))
    for memory in ([], ["--gpu-memory", "1GiB"]):
        assert main([*argv, *memory]) == 0
        assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] == round(1.25 * plain)


def test_a_calibration_applies_to_its_gpu_model_only(own_calibration):
    """Matched by whole words: H100 is "NVIDIA H100 80GB HBM3"; H20 is not H200, nor L4 L40S."""
    devices = {name: {"scale": scale, "samples": 1} for name, scale in (("NVIDIA H200", 1.5), ("NVIDIA L40S", 1.25))}
    devices |= {"NVIDIA H100 80GB HBM3": {"scale": 1.125}}
    own_calibration.write_text(json.dumps({"version": 1, "devices": devices}))
    scales = {name: calibrate.overheads_for("cuda", name).scale for name in ("H20", "L4", "H200", "H100")}
    default = calibrate.DEFAULTS["cuda"].scale
    assert scales == {"H20": default, "L4": default, "H200": 1.5, "H100": 1.125}


def test_a_damaged_calibration_entry_counts_as_none_saved(own_calibration, capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "64", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["peak_allocated_bytes"]
    own_calibration.write_text(json.dumps({"version": 1, "devices": {"cpu": {"scale": "x"}}}))
    assert main(argv) == 0  # it crashed with a TypeError in every plan
    assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] == plain


def test_plan_table_for_a_gpu_recipe(capsys):
    argv = ["plan", "--model", "fsdp/llama-tiny", "--gpus", "8", "--gpu", "H100-80GB", "--seq-len", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # The capacity torch reports on an H100 (the driver keeps the rest of the 80 GiB), not the nominal size.
    assert "peak allocated per rank" in out and "fits in 79.11 GiB" in out
    assert "MiB ┃" in out  # the column in the peak's unit: a tiny model's parts read 0.00 GiB


@pytest.mark.parametrize(
    "extra",
    [
        ["--gpu", "Z999"],
        ["--recompute", "9"],
        ["--recompute", "sometimes"],
        ["--seq-len", "100000"],
        ["--gpu-memory", "lots"],
        ["--micro-batch", "0"],
    ],
)
def test_plan_bad_input_is_exit_2(extra, capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--gpu-memory", "1GiB"]
    if "--gpu" in extra or "--gpu-memory" in extra:
        argv = argv[:-2]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]


@pytest.mark.parametrize(
    ("model", "config", "extra", "message"),
    [
        ("deepspeed", {"zero_optimization": {"stage": 3}}, ["--zero-stage", "2"], "contradicts"),
        ("deepspeed", {"zero_optimization": {"stage3_max_live_parameters": "lots"}}, [], "max_live"),
        ("deepspeed", {"zero_optimization": {"overlap_comm": "yes"}}, [], "overlap_comm"),
        ("torch", {"zero_optimization": {"stage": 3}}, [], "deepspeed engine"),
        ("deepspeed", None, [], "no such file"),
    ],
)
def test_plan_deepspeed_config_errors_are_exit_2(model, config, extra, message, tmp_path, capsys):
    path = tmp_path / "ds.json"
    if config is not None:
        path.write_text(json.dumps(config))
    argv = ["plan", "--model", f"{model}/llama-tiny", "--device", "cpu", "--deepspeed-config", str(path), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


DS_PLAN = ["plan", "--model", "deepspeed/llama-tiny", "--device", "cpu", "--gpus", "2", "--seq-len", "64"]


def plan_with_config(config: dict, tmp_path, capsys, *extra: str) -> tuple[int, dict | None, str]:
    """``ljperf plan --json`` of ``DS_PLAN`` with ``config`` as --deepspeed-config: (exit code, record, stderr)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code = main([*DS_PLAN, "--gpu-memory", "1GiB", "--deepspeed-config", str(path), "--json", *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else None, captured.err


def test_plan_takes_batch_and_stage_from_the_deepspeed_config_unless_a_flag_is_given(tmp_path, capsys):
    """The numbers of --deepspeed-config stand in for flags left out, as in ``ljperf benchmark``; a given flag
    that contradicts one is exit 2 naming both; an "auto" is the flag's."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}}
    code, record, _ = plan_with_config(config, tmp_path, capsys)
    recipe = record["recipe"]
    assert code == 0 and (recipe["micro_batch"], recipe["grad_accum"], recipe["zero_stage"]) == (4, 8, 2)
    assert plan_with_config(config, tmp_path, capsys, "--micro-batch", "4", "--zero-stage", "2")[0] == 0
    code, _, err = plan_with_config(config, tmp_path, capsys, "--micro-batch", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "train_micro_batch_size_per_gpu is 4 but ljperf runs --micro-batch 2" in err
    code, _, err = plan_with_config(config, tmp_path, capsys, "--grad-accum", "1")
    assert code == 2 and "gradient_accumulation_steps is 8 but ljperf runs --grad-accum 1" in err
    # train_batch_size must be micro × accumulation × world (2 ranks)
    code, _, err = plan_with_config({**config, "train_batch_size": 32}, tmp_path, capsys)
    assert code == 2 and "train_batch_size 32 ≠ 4 (micro) × 8 (accumulation) × 2 (world) = 64" in err
    assert plan_with_config({**config, "train_batch_size": 64}, tmp_path, capsys)[0] == 0
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
    code, record, _ = plan_with_config(auto, tmp_path, capsys, "--micro-batch", "2")
    recipe = record["recipe"]
    assert code == 0 and (recipe["micro_batch"], recipe["grad_accum"], recipe["zero_stage"]) == (2, 1, 3)


def test_plan_runs_the_benchmarks_deepspeed_config_lint(tmp_path, capsys):
    """Warnings are printed (and in the JSON); a fail, or a precision ljperf does not run, is exit 2."""
    config = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7}, "wall_clock_breakdwn": True}
    code, record, _ = plan_with_config(config, tmp_path, capsys)
    assert code == 0
    warnings = record["warnings"]
    assert len(warnings) == 2 and "stage3_prefetch_bucket_size" in warnings[1], warnings
    assert "did you mean 'wall_clock_breakdown'" in warnings[0]
    path = tmp_path / "ds.json"
    assert main([*DS_PLAN, "--gpu-memory", "1GiB", "--deepspeed-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: zero_optimization.stage3_prefetch_bucket_size is a fixed number" in out
    both = {"bf16": {"enabled": True}, "fp16": {"enabled": True}}
    code, _, err = plan_with_config(both, tmp_path, capsys, "--precision", "bf16-mixed")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "fp16.enabled is true" in err


def test_plan_finds_the_largest_micro_batch_past_4096(capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "64", "--gpu-memory", "80GiB"]
    assert main([*argv, "--micro-batch", "16384", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["max_micro_batch"]
    assert out["fits"] and best > 16384
    recipe = Recipe(device="cpu", precision="fp32", seq_len=64)
    spec = resolve(name="llama-tiny")
    assert forecast(spec, recipe.with_(micro_batch=best)).device_bytes <= 80 * 1024**3
    assert forecast(spec, recipe.with_(micro_batch=best + 1)).device_bytes > 80 * 1024**3


def test_gpu_names_in_any_case_and_a_model_alone_when_unambiguous(capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--seq-len", "64", "--json"]
    memory = {}
    for name in ("H100-80GB", "h100-80gb", "H100", "h100", "h20"):
        assert main([*argv, "--gpu", name]) == 0, capsys.readouterr().err
        memory[name] = json.loads(capsys.readouterr().out)["gpu_memory_bytes"]
    assert len({memory[name] for name in ("H100-80GB", "h100-80gb", "H100", "h100")}) == 1
    assert memory["h20"] == round(94.97 * 1024**3)  # H20-96GB, not H200-141GB
    assert main([*argv, "--gpu", "a100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "A100-40GB, A100-80GB" in err[0]


def test_plan_output_keeps_each_note_on_one_line_and_zero_for_deepspeed(capsys):
    argv = ["plan", "--model", "fsdp/llama-tiny", "--gpus", "2", "--gpu", "H100-80GB", "--seq-len", "64"]
    assert main(argv) == 0
    (note,) = [line for line in capsys.readouterr().out.splitlines() if "CUDA overheads" in line]
    assert note.endswith("then plan again"), note  # rich broke it at 140 columns in a pipe
    assert main([*argv, "--json"]) == 0
    assert not {"zero_stage", "zero"} & set(json.loads(capsys.readouterr().out)["recipe"])
    assert main([*DS_PLAN, "--gpu-memory", "1GiB", "--json"]) == 0
    recipe = json.loads(capsys.readouterr().out)["recipe"]
    assert recipe["zero_stage"] == 3 and recipe["zero"]["prefetch_bucket_size"] == 50_000_000


def test_calibration_fits_scale_and_offset(tmp_path, monkeypatch, capsys):
    def record(predicted: int, measured: int) -> dict:
        return {
            "env": {"devices": ["NVIDIA H200"]},
            "config": {"train": {"device": "cuda"}},
            "results": {
                "status": "ok",
                "peak_allocated_bytes": measured,
                "peak_reserved_bytes": int(measured * 1.1),
                "forecast": {"traced_peak_allocated_bytes": predicted},
            },
        }

    paths = []
    for i, (p, m) in enumerate([(10_000, 11_000 + 500), (20_000, 22_000 + 500)]):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(record(p, m)))
        paths.append(str(path))
    fitted = calibrate.calibrate(paths, out=tmp_path / "calibration.json")["NVIDIA H200"]
    assert fitted.scale == pytest.approx(1.1) and fitted.offset == 500
    assert fitted.reserved_scale == pytest.approx(1.1, rel=1e-3)
    assert calibrate.load(tmp_path / "calibration.json")["NVIDIA H200"].samples == 2
    # Two records 10% apart, one 2 GiB over its forecast: least squares gave scale -1, and 70B a negative peak
    GiB = 1024**3
    close = [tmp_path / "c0.json", tmp_path / "c1.json"]
    for path, (p, m) in zip(close, [(10 * GiB, 12 * GiB), (11 * GiB, 11 * GiB)], strict=True):
        path.write_text(json.dumps(record(p, m)))
    fitted = calibrate.calibrate(list(map(str, close)), out=tmp_path / "close.json")["NVIDIA H200"]
    assert fitted.scale == 1.0 and fitted.offset == GiB  # the offset alone: the mean miss
    # The command: --json prints what it fitted (it printed the text lines); a --model is refused, not ignored
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["plan", "--calibrate", *paths, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"]["NVIDIA H200"]["offset"] == 500 and out["saved_to"] == str(
        tmp_path / "cache" / "calibration.json"
    )
    assert main(["plan", "--calibrate", *paths, "--model", "torch/llama3-8b"]) == 2
    assert "it takes no --model" in capsys.readouterr().err


WORKER = os.path.join(os.path.dirname(__file__), "scripts", "engines_worker.py")
SHAPE = "--micro-batch 2 --seq-len 128 --steps 1 --warmup 2 --device cpu"
SMALL = "--micro-batch 1 --seq-len 32 --grad-accum 2 --steps 1 --warmup 2 --device cpu"
STEP_BOUND = "--micro-batch 1 --seq-len 32 --steps 1 --warmup 2 --device cpu"  # activations smaller than the states
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
RANKS_DIFFER = {"zero2-foreach-accum"}  # ZeRO-2's gradient partitions differ in size and in when they are made
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
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: json.loads((out / f"{name}.json").read_text())["results"] for name in DISTRIBUTED}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "tolerance"),
    # Measured: DDP, FSDP2, ZeRO-3 at b2 s128 -0.01% (a few KiB of scalars); at b1 s32 accum 2 ZeRO-1 -0.00%,
    # ZeRO-2 -0.00% (peak in the optimizer step), ZeRO-3 -0.05% (peak in forward).
    [
        ("ddp", 0.01),
        ("fsdp", 0.01),
        # DeepSpeed's gloo reduce-scatter copies are made on gloo's own threads, so whether one is alive at the
        # measured peak varies run to run (ZeRO-2 small measured 20.20 MB once, 20.96 MB another time: +3.6%).
        # 5% is within the 10% for sharded engines.
        ("zero3", 0.05),
        ("zero3-small", 0.05),
        ("zero2-small", 0.05),
        ("zero1-small", 0.05),
        # Measured: -0.01% (FSDP2, ZeRO-3 at b2 s128, peak in the head's backward), -0.00% (ZeRO-3 small: the
        # optimizer step with its fp32 copy of the bf16 gradient partition).
        ("fsdp-bf16", 0.01),
        ("fsdp-bf16-weights", 0.01),  # measured -0.0% (bf16 shards, moments and reduce-scatter)
        ("zero3-bf16", 0.05),
        ("zero3-small-bf16", 0.05),
        # Measured -0.02% and -0.15%; +10% and +5% when kept gradients were counted in fp32.
        ("zero1-accum-bf16", 0.05),
        ("zero2-accum-bf16", 0.05),
        # Measured -0.19% (the head's backward) and -0.00% (the optimizer step).
        ("zero3-window", 0.05),
        ("zero3-window-small", 0.05),
        ("zero3-window-12l", 0.05),  # measured -0.06%
        # Measured +0.34% (ZeRO-2) and -0.01% (ZeRO-1); both were -8.5% before the IPG bucket was modelled.
        ("zero2-bucket", 0.05),
        ("zero1-bucket", 0.05),
        # Measured +0.3% (ZeRO-2) and +1.6% (ZeRO-1); ZeRO-2 was -19.4% with one buffer counted.
        ("zero2-overlap", 0.05),
        ("zero1-overlap", 0.05),
        # Measured -0.32% and +2.3% in two runs (ZeRO-1: the boundary's partition copy, gloo's copies vary) and
        # -0.37% (ZeRO-2: the optimizer step); they were +12% and +28% with the model's parameters as foreach's
        # copy, ZeRO-1 -13% without the partition copy.
        ("zero1-foreach", 0.05),
        ("zero2-foreach", 0.05),
        # The highest rank's peak: measured -0.4% (rank 1, its partition made in the LM head's backward; rank 0
        # makes its own at the embedding, +5.6%); -11.4% with one partition of a shard's size.
        ("zero2-foreach-accum", 0.05),
        # Measured -0.1% (the fp64 copy of the embedding's gradient for the norm); -10.7% without it.
        ("zero2-foreach-vocab", 0.05),
        # Measured -0.0%; +7.9% with the fp32 partition held at the norm.
        ("zero1-foreach-vocab-bf16", 0.05),
        # Measured -0.00%; +19.9% with the whole partition stepped at once.
        ("zero3-foreach-subgroups", 0.05),
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
