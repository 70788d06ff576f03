"""Where a model keeps its repeated blocks: an HF causal LM's decoder layers, or any model's longest ModuleList.

Run: ``decoder_layers(model)``, ``find_blocks(model)``: what engines shard, the forecast traces, recompute plans
address and regional compile compiles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ljperf.core.errors import UsageError

if TYPE_CHECKING:
    import torch


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers``, or GPT-2's ``transformer.h``): what engines
    shard, the forecast traces and recompute plans address."""
    import torch

    # Llama 4's causal LM returns itself as its decoder (its base-model prefix names the multimodal model's part)
    decoder = model.get_decoder()
    layers = (
        getattr(decoder, "layers", None)
        or getattr(decoder, "h", None)
        or getattr(getattr(model, "model", None), "layers", None)
    )
    if not isinstance(layers, torch.nn.ModuleList):
        raise UsageError(
            f"{type(model).__name__} keeps its decoder layers elsewhere than model.layers or transformer.h; ljperf"
            " runs decoder-only causal LMs laid out as Llama, Qwen, Gemma and OPT are (model.layers) or as GPT-2 and"
            " Falcon are (transformer.h)"
        )
    return layers


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks in order: HF decoder layers, else the longest ModuleList of one class."""
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    hf = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if hf:
        return hf
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            if len({type(block) for block in module}) == 1:
                best = list(module)
    if not best:
        raise UsageError(f"{type(model).__name__} has no repeated blocks (no ModuleList): cannot checkpoint it")
    return best
