"""Pieces the engines share: the AdamW they all use, the blocks they shard by, parameter names for initial values."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ljperf.core.options import default_adamw_impl
from ljperf.models.build import parameter_slots
from ljperf.models.layout import decoder_layers
from ljperf.run.context import RunContext

IMPL_KWARGS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
"""AdamW's arguments for each ``--optimizer-impl``."""


def adamw(params: Iterable[torch.Tensor], *, run: RunContext) -> torch.optim.AdamW:
    """AdamW as the torch and fsdp engines use it, in ``--optimizer-impl``'s implementation (default: fused on
    CUDA, single on a CPU)."""
    kwargs = IMPL_KWARGS[run.optim.optimizer_impl or default_adamw_impl(run.device.type)]
    return torch.optim.AdamW(params, lr=run.train.lr, betas=(0.9, 0.95), weight_decay=0.1, **kwargs)


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (``model.model.layers`` or ``transformer.h``): the unit engines shard
    by."""
    return list(decoder_layers(model))


def parameter_names(model: torch.nn.Module) -> dict[tuple[int, str], str]:
    """(id(module), attribute) → the parameter's name in the plain HF model (a tied weight: its first name).

    Modules keep their identity through checkpoint/compile wrappers and sharding (which replaces the parameter
    objects), so engines that materialise after wrapping still find each parameter's ``init_value`` name.
    """
    first = {id(p): n for n, p in model.named_parameters()}
    return {(id(module), key): first[id(param)] for module, key, param in parameter_slots(model)}
