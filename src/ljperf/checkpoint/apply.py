"""Apply a per-layer recompute plan: ``none`` keeps every activation, ``selective`` keeps the matmul and
attention outputs and recomputes the cheap pointwise ops, ``full`` keeps only the layer's inputs.

HF decoder layers (``GradientCheckpointingLayer``) get their own per-layer flag; any other model's repeated
blocks (the longest ``ModuleList`` of one block class) get a forward that checkpoints. Both checkpoint the
block's ``forward``, not ``__call__``, so FSDP2/ZeRO-3 module hooks stay outside and do not run twice.
Always non-reentrant, so it composes with FSDP2, ZeRO-3 and torch.compile; apply before sharding/compile.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.utils.checkpoint import SelectiveCheckpointContext

from ljperf.core.plans import MODES, Plan
from ljperf.models.layout import find_blocks

# Outputs that cost FLOPs to recompute: matmuls (a mixture of experts' grouped ones too: torch's, and the fallback
# op transformers runs where torch's cannot) and fused attention. Everything else (norms, rotary, activation
# functions, residual adds, dtype casts, routing) is memory-bound and recomputed.
GROUPED_MM_OPS = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback"})
"""Experts' matmuls: (tokens × top-k, in) by (experts, in, out)."""
SAVE_OPS = GROUPED_MM_OPS | frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
    }
)
"""Operator names (``OpOverload.name()``), so that ops registered after import (transformers') match too."""


def saves(op: object) -> bool:
    """Whether selective recompute keeps ``op``'s output (``SAVE_OPS``)."""
    name = getattr(op, "name", None)
    return callable(name) and name() in SAVE_OPS


def _selective_policy(ctx: SelectiveCheckpointContext, op: OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if saves(op) else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_fn(mode: str) -> Callable[..., Any]:
    """``torch.utils.checkpoint.checkpoint`` configured for ``mode`` (``full`` or ``selective``)."""
    if mode == "selective":
        context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        return functools.partial(checkpoint, use_reentrant=False, context_fn=context)
    return functools.partial(checkpoint, use_reentrant=False)


def apply_plan(model: torch.nn.Module, plan: Sequence[str]) -> list[torch.nn.Module]:
    """Set each block's recompute mode; idempotent, so a later call re-plans. Returns the blocks."""
    blocks = find_blocks(model)
    if len(plan) != len(blocks):
        raise ValueError(f"plan has {len(plan)} entries for {len(blocks)} layers")
    for block, mode in zip(blocks, plan, strict=True):
        if mode not in MODES:
            raise ValueError(f"recompute mode {mode!r}: choose one of {', '.join(MODES)}")
        _set_mode(block, mode)
    return blocks


def _set_mode(block: torch.nn.Module, mode: str) -> None:
    from transformers.modeling_layers import GradientCheckpointingLayer

    block._ljperf_recompute = mode
    if isinstance(block, GradientCheckpointingLayer):
        block.gradient_checkpointing = mode != "none"
        block._gradient_checkpointing_func = checkpoint_fn(mode)
    elif "forward" not in block.__dict__:
        # An instance attribute: other instances of the class are untouched, deepcopy rebinds it.
        block.forward = types.MethodType(_checkpointed_forward, block)


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # type(self).forward, looked up per call: FSDP2 swaps the class for a subclass after this is set.
    forward = functools.partial(type(self).forward, self)
    mode = self._ljperf_recompute
    if mode == "none" or not (self.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    return checkpoint_fn(mode)(forward, *args, **kwargs)


def current_plan(model: torch.nn.Module) -> Plan:
    """The mode each block runs with now (HF layers enabled by the user's own flag count as ``full``)."""
    modes = []
    for block in find_blocks(model):
        mode = getattr(block, "_ljperf_recompute", None)
        if mode is None:
            mode = "full" if getattr(block, "gradient_checkpointing", False) else "none"
        modes.append(mode)
    return tuple(modes)
