"""Where a model keeps its repeated blocks: an HF causal LM's decoder layers, or any model's longest ModuleList.

Run: ``decoder_layers(model)``, ``find_blocks(model)``: what engines shard, the forecast traces, recompute plans
address and regional compile compiles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ljperf.core.errors import UsageError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

TENSOR_PARALLEL = {"llama": "Llama", "qwen2": "Qwen 2", "qwen3": "Qwen 3", "mistral": "Mistral"}
"""Model types whose decoders ``models.tensor_parallel`` splits (model_type → name): q/k/v, o and gate/up/down
projections, RMSNorms, an embedding and an LM head, laid out as Llama's."""


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers``, or GPT-2's ``transformer.h``): what engines
    shard, the forecast traces and recompute plans address. Any module laid out as one (a wrapper that forwards
    attribute lookups to it, such as PEFT's) answers alike."""
    import torch

    # Llama 4's causal LM returns itself as its decoder (its base-model prefix names the multimodal model's part)
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
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

    hf: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
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


def embeddings(model: PreTrainedModel) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """An HF causal LM's input embedding and its LM head (None: it has none, as a pipeline stage has neither or
    one: ``models.stages``), as transformers finds them."""
    import torch

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()  # unannotated: a module or None
    known = [
        m if isinstance(m, torch.nn.Module) and not isinstance(m, torch.nn.Identity) else None for m in (embed, head)
    ]
    return known[0], known[1]


def weight(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` (an embedding's, an LM head's): torch types a module's attributes as tensor or module."""
    import torch

    value = module.weight
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is a {type(value).__name__}, not a tensor")
    return value
