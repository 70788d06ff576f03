"""Tensor parallel (with sequence parallel and loss parallel) for the decoders of ``layout.TENSOR_PARALLEL``
(Llama, Qwen 2/3, Mistral), as PyTorch's ``parallelize_module`` expresses it, in torchtitan's plan for Llama.

Run: ``parallelize(model, tp_mesh)`` on an HF causal LM (meta, fake or real parameters) before checkpointing,
compile and FSDP2, then train under ``loss_parallel()``: the engines' FSDP2 path and the forecast's trace both
call these, so the forecast traces the code that trains.

Each decoder layer's q/k/v and gate/up projections split column-wise (each rank computes whole heads and a slice
of the MLP's width), o and down row-wise; their outputs are reduce-scattered over the sequence, so the norms and
the residual stream hold ``seq_len / tp`` tokens per rank (sequence parallel) and are all-gathered before the next
projections. The embedding splits the vocabulary; the LM head's logits stay split over it and the cross-entropy
runs on the shards (``loss_parallel``). transformers' attention reshapes with ``view(*shape, -1, head_dim)``, so
the local heads need no change of the config; Qwen 3's per-head norms run on the local heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ljperf.models.layout import decoder_layers, embeddings, weight

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def root_plan(model: torch.nn.Module | None = None) -> dict[str, ParallelStyle]:
    """The embedding (its output sharded over the sequence), the final norm and the LM head (logits sharded over
    the vocabulary, for the loss); of ``model``'s, those it holds (a pipeline stage holds the embedding on the
    first stage, the norm and head on the last: ``models.stages``)."""
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    if model is None:
        return plan
    held = {name for name, module in model.named_modules() if not isinstance(module, torch.nn.Identity)}
    return {name: style for name, style in plan.items() if name in held}


def layer_plan(layer: torch.nn.Module) -> dict[str, ParallelStyle]:
    """One decoder layer: norms over the sequence, attention and MLP gathered over it and split by heads and
    width. The residual stream stays a DTensor (``use_local_output=False``): transformers reads the sequence
    length from its global shape."""
    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(**gather),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for norm in ("q_norm", "k_norm"):  # Qwen 3: an RMSNorm over each head's width, on (batch, seq, heads, width)
        if hasattr(layer.self_attn, norm):
            plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def parallelize(model: PreTrainedModel, tp_mesh: DeviceMesh) -> PreTrainedModel:
    """Split ``model`` over ``tp_mesh`` in place: every parameter becomes a DTensor of it; a tied LM head is tied
    again to the embedding (both split over the vocabulary)."""
    embed, head = embeddings(model)
    tied = head is not None and embed is not None and weight(head) is weight(embed)
    parallelize_module(model, tp_mesh, root_plan(model))
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, layer_plan(layer))
    embed, head = embeddings(model)
    if tied and head is not None and embed is not None:
        head.weight = weight(embed)
    plain = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if plain:
        raise RuntimeError(f"tensor parallel left {plain[0]} whole: {type(model).__name__} is not laid out as Llama")
    return model
