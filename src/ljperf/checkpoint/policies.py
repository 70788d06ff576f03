"""Activation checkpointing policies: small objects whose one ``apply(model)`` sets how each of the model's
repeated blocks recomputes in backward, and returns the blocks.

Run: ``FullRecompute().apply(model)``, ``PerLayerRecompute(("full", "selective", "none", "none")).apply(model)``,
``every_layer(mode).apply(model)``; ``current_plan(model)`` reads back what runs.

- ``NoRecompute``: every activation kept.
- ``SelectiveRecompute``: the matmul and attention outputs kept (``SAVE_OPS``), the cheap pointwise ops recomputed.
- ``FullRecompute``: only each block's inputs kept, its whole forward recomputed.
- ``PerLayerRecompute``: one of those modes per block (``--recompute K`` and ``MODE,...``); ``--recompute auto``
  resolves to one through the solver (``recompute.solver.Decision.policy``), before the engine is built.

HF decoder layers (``GradientCheckpointingLayer``) get their own per-layer flag; any other model's repeated
blocks (the longest ``ModuleList`` of one block class) get a forward that checkpoints. Both checkpoint the
block's ``forward``, not ``__call__``, so FSDP2/ZeRO-3 module hooks stay outside and do not run twice.
Always non-reentrant, so it composes with FSDP2, ZeRO-3 and torch.compile; apply before sharding/compile.
Applying is idempotent: a later ``apply`` re-plans.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ljperf.core.plans import MODES, Plan, RecomputeMode, is_mode
from ljperf.models.layout import find_blocks

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.utils.checkpoint import SelectiveCheckpointContext

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

_MODE = "_ljperf_recompute"
"""The block attribute that holds the mode a policy set on it."""
_HF_CHECKPOINT_FN = "_gradient_checkpointing_func"
"""What an HF layer (``GradientCheckpointingLayer``) calls to checkpoint its forward while its flag is on."""


def saves(op: object) -> bool:
    """Whether selective recompute keeps ``op``'s output (``SAVE_OPS``)."""
    name = getattr(op, "name", None)
    return callable(name) and name() in SAVE_OPS


@dataclass(frozen=True)
class EveryLayer:
    """One mode for every block; ``mode`` names it."""

    mode: ClassVar[RecomputeMode]

    def apply(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        blocks = find_blocks(model)
        for block in blocks:
            self.set_on(block)
        return blocks

    def checkpoint_fn(self) -> Callable[..., Any]:
        """``torch.utils.checkpoint.checkpoint`` as this mode runs it, non-reentrant (what an HF layer calls when
        its flag is on; for ``none`` the flag is off and the function never runs)."""
        return functools.partial(checkpoint, use_reentrant=False)

    def set_on(self, block: torch.nn.Module) -> None:
        """This mode on one block: an HF layer's own flag and checkpoint function, else a forward that checks the
        block's mode at each call."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        setattr(block, _MODE, self.mode)
        if isinstance(block, GradientCheckpointingLayer):
            block.gradient_checkpointing = self.mode != "none"
            setattr(block, _HF_CHECKPOINT_FN, self.checkpoint_fn())
        elif "forward" not in block.__dict__:
            # An instance attribute: other instances of the class are untouched, deepcopy rebinds it.
            block.forward = types.MethodType(_checkpointed_forward, block)


@dataclass(frozen=True)
class NoRecompute(EveryLayer):
    """Every activation kept."""

    mode: ClassVar[RecomputeMode] = "none"


@dataclass(frozen=True)
class FullRecompute(EveryLayer):
    """Only each block's inputs kept; backward reruns the block's forward."""

    mode: ClassVar[RecomputeMode] = "full"


@dataclass(frozen=True)
class SelectiveRecompute(EveryLayer):
    """Op-level selective checkpointing: ``SAVE_OPS`` outputs kept, everything else recomputed."""

    mode: ClassVar[RecomputeMode] = "selective"

    def checkpoint_fn(self) -> Callable[..., Any]:
        context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        return functools.partial(checkpoint, use_reentrant=False, context_fn=context)


def _selective_policy(ctx: SelectiveCheckpointContext, op: OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if saves(op) else CheckpointPolicy.PREFER_RECOMPUTE


_EVERY_LAYER: dict[RecomputeMode, EveryLayer] = {
    p.mode: p for p in (NoRecompute(), SelectiveRecompute(), FullRecompute())
}


def every_layer(mode: str) -> EveryLayer:
    """The policy of one mode (one of ``MODES``) for every block."""
    if not is_mode(mode):
        raise ValueError(f"recompute mode {mode!r}: choose one of {', '.join(MODES)}")
    return _EVERY_LAYER[mode]


@dataclass(frozen=True)
class PerLayerRecompute:
    """One mode per block, in block order: ``--recompute K`` or ``MODE,...``, or the plan ``auto`` resolved to."""

    plan: Plan

    def __post_init__(self) -> None:
        for mode in self.plan:
            if not is_mode(mode):
                raise ValueError(f"recompute mode {mode!r}: choose one of {', '.join(MODES)}")

    def apply(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        blocks = find_blocks(model)
        if len(self.plan) != len(blocks):
            raise ValueError(f"plan has {len(self.plan)} entries for {len(blocks)} layers")
        for block, mode in zip(blocks, self.plan, strict=True):
            _EVERY_LAYER[mode].set_on(block)
        return blocks


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # type(self).forward, looked up per call: FSDP2 swaps the class for a subclass after this is set.
    forward = functools.partial(type(self).forward, self)
    mode = getattr(self, _MODE)
    if mode == "none" or not (self.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    return _EVERY_LAYER[mode].checkpoint_fn()(forward, *args, **kwargs)


def current_plan(model: torch.nn.Module) -> Plan:
    """The mode each block runs with now (HF layers enabled by the user's own flag count as ``full``)."""
    modes: list[RecomputeMode] = []
    for block in find_blocks(model):
        mode = getattr(block, _MODE, None)
        if mode is None:
            mode = "full" if getattr(block, "gradient_checkpointing", False) else "none"
        modes.append(mode)
    return tuple(modes)


def script_checkpoints(model: torch.nn.Module) -> bool:
    """Whether a script turned HF gradient checkpointing on itself (``TrainingArguments(gradient_checkpointing=
    True)``, ``model.gradient_checkpointing_enable()``): a layer checkpoints that no policy set."""
    return any(
        getattr(block, "gradient_checkpointing", False) and not hasattr(block, _MODE) for block in find_blocks(model)
    )
