"""Pieces the engines share: the micro-step loop and the AdamW they all use."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

from ljperf import models
from ljperf.runtime import RunContext


def causal_lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of an HF causal LM on ``tokens`` (labels are the inputs, shifted inside)."""
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def accumulate(
    model: torch.nn.Module,
    micro_batches: list[torch.Tensor],
    *,
    run: RunContext,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> torch.Tensor:
    """Forward and backward over the micro-batches, gradients averaged; returns the mean loss (detached).

    ``no_sync`` (DDP) skips the gradient all-reduce on all but the last micro-step.
    """
    total = torch.zeros((), device=run.device.torch_device)
    n = len(micro_batches)
    for i, tokens in enumerate(micro_batches):
        sync = no_sync() if no_sync is not None and i < n - 1 else contextlib.nullcontext()
        with sync, run.autocast():
            loss = causal_lm_loss(model, tokens) / n
        loss.backward()
        total += loss.detach()
    return total


def adamw(params: Iterable[torch.Tensor], *, run: RunContext) -> torch.optim.AdamW:
    """AdamW as every engine uses it; torch picks foreach on CUDA and the single-tensor loop on CPU."""
    return torch.optim.AdamW(params, lr=run.train.lr, betas=(0.9, 0.95), weight_decay=0.1)


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (``model.model.layers`` or ``transformer.h``): the unit engines shard
    by."""
    return list(models.decoder_layers(model))


def parameter_names(model: torch.nn.Module) -> dict[tuple[int, str], str]:
    """(id(module), attribute) → the parameter's name in the plain HF model (a tied weight: its first name).

    Modules keep their identity through checkpoint/compile wrappers and sharding (which replaces the parameter
    objects), so engines that materialise after wrapping still find each parameter's ``init_value`` name.
    """
    first = {id(p): n for n, p in model.named_parameters()}
    return {(id(module), key): first[id(param)] for module, key, param in models.parameter_slots(model)}
