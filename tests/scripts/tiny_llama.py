"""The tiny Llama of the startup-hook test scripts: its config, shape, data, and a count of each layer's MLP
calls (a checkpointed layer runs its MLP again in backward)."""

import json
import os
import sys

import torch

# ljperf's catalog llama-tiny (src/ljperf/models/catalog/llama-tiny.json) at 6 layers: the forecasts the hook
# makes for it are then the suite's cached traces of that model (the trace leaves the depth out of its key)
CONFIG = {
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
# HOOK_SCRIPT_MICRO_BATCH: a larger batch on a GPU (benchmarks/gpu_session.sh), where activations must outweigh
# the device's fixed overheads for the plan to be tested
MICRO_BATCH, SEQ_LEN = int(os.environ.get("HOOK_SCRIPT_MICRO_BATCH", "4")), 256


def build():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG))


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s token ids of training step ``step``; ``SEQ_LEN_BY_RANK=128,256`` gives each rank its own
    length (as an HF data collator that pads each batch to its longest sequence does)."""
    lengths = os.environ.get("SEQ_LEN_BY_RANK")
    seq_len = int(lengths.split(",")[rank]) if lengths else SEQ_LEN
    return torch.randint(
        0, CONFIG["vocab_size"], (MICRO_BATCH, seq_len), generator=torch.Generator().manual_seed(step * 100 + rank)
    )


def count_mlp_calls(model) -> list[int]:
    """One counter per decoder layer, incremented by every call of its MLP."""
    counts = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def checkpointed(model) -> list[bool]:
    """Each decoder layer's checkpointing flag."""
    return [bool(layer.gradient_checkpointing) for layer in model.model.layers]


def print_report(losses: list[float], model, calls: list[int], steps: int, **extra) -> None:
    """The one JSON line the tests read: losses, which layers checkpoint, MLP calls per step, ljperf loaded."""
    report = {
        **extra,
        "losses": losses,
        "checkpointed": checkpointed(model),
        "mlp_calls_per_step": [c / steps for c in calls],
        "ljperf_imported": "ljperf" in sys.modules,
    }
    print(json.dumps(report), flush=True)


def leave_group() -> None:
    """Leave the process group as a careful script does: a barrier and a short sleep first. gloo's threads free a
    finished collective after ``wait()`` returns, and a group destroyed at once can abort the process at exit on
    a loaded CPU ("terminate called without an active exception": 2 in 5 plain DeepSpeed runs without ljperf,
    with two busy processes beside them). ``ljperf.distributed.runtime.shutdown_process`` does the same."""
    import time

    import torch.distributed as dist

    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()
