"""The training micro-steps every engine runs and the forecast traces: next-token loss, forward and backward.

Run: ``accumulate(model, [tokens], autocast=contextlib.nullcontext)`` → the mean loss, gradients accumulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from ljperf.core.phases import phase


def causal_lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of an HF causal LM on ``tokens`` (labels are the inputs, shifted inside); a
    tensor-parallel model's (``loss_parallel``: a DTensor replicated over its ranks) as this rank's tensor."""
    loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    return loss.to_local() if isinstance(loss, DTensor) else loss


def accumulate(
    model: torch.nn.Module,
    micro_batches: list[torch.Tensor],
    *,
    autocast: Callable[[], contextlib.AbstractContextManager],
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> torch.Tensor:
    """Forward (under ``autocast()``) and backward over the micro-batches, gradients averaged; returns the mean
    loss (detached). ``no_sync`` (DDP) skips the gradient all-reduce on all but the last micro-step."""
    total = torch.zeros((), device=micro_batches[0].device)
    n = len(micro_batches)
    for i, tokens in enumerate(micro_batches):
        sync = no_sync() if no_sync is not None and i < n - 1 else contextlib.nullcontext()
        with sync, autocast(), phase("forward"):
            loss = causal_lm_loss(model, tokens) / n
        with phase("backward"):
            loss.backward()
        total += loss.detach()
    return total
