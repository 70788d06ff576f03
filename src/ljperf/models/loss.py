"""The chunked next-token loss of ``--loss chunked``: the LM head and cross-entropy over a micro-batch's tokens in
``LOSS_CHUNKS`` chunks, each recomputed in backward, so the whole logits tensor never exists.

Run: ``use_chunked_loss(model)`` on an HF causal LM, once; ``model(input_ids=t, labels=t).loss`` is then the mean
loss HF's ``ForCausalLMLoss`` gives (``logits`` is None).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ljperf.core.errors import UsageError
from ljperf.core.options import LOSS_CHUNKS
from ljperf.models.layout import embeddings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IGNORE_INDEX = -100
"""The label HF's loss skips (``ForCausalLMLoss``'s ``ignore_index``): the padded position after each sequence."""


def use_chunked_loss(model: torch.nn.Module) -> None:
    """Give ``model`` (in place) a forward that runs its decoder body, then the chunked loss; engines' hooks on the
    model (FSDP2's root, DeepSpeed's, DDP's) still wrap it, as the head is still called as a module."""
    model.forward = types.MethodType(_chunked_forward, model)


def _chunked_forward(
    self: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any
) -> Any:
    """HF's forward with the chunked loss (a ``CausalLMOutputWithPast``; ``logits`` None when a loss is asked)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast  # a warm plan never imports transformers

    hidden = self.base_model(input_ids=input_ids, **kwargs)[0]
    if labels is None:
        return CausalLMOutputWithPast(logits=_logits(self, hidden))
    return CausalLMOutputWithPast(loss=chunked_loss(self, hidden, labels))


def chunk_sizes(tokens: int, chunks: int = LOSS_CHUNKS) -> list[int]:
    """``tokens`` split into ``chunks`` (at most one a token) as evenly as they go: the first ones a token longer."""
    n = max(1, min(chunks, tokens))
    return [tokens // n + (i < tokens % n) for i in range(n)]


def chunked_loss(model: PreTrainedModel, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next tokens over those not ignored, as HF's ``ForCausalLMLoss`` shifts and counts
    them, from the decoder's last ``hidden`` states: each chunk's head and loss is a non-reentrant checkpoint, which
    keeps only its slice of ``hidden`` (already kept) and recomputes the logits in backward."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1).to(hidden.device)
    count = (shifted != IGNORE_INDEX).sum()
    flat = hidden.reshape(-1, hidden.shape[-1])
    sizes = chunk_sizes(flat.shape[0])
    # split (not tensor_split, whose slices each make a whole-size gradient): one backward node joins the chunks';
    # no RNG state kept for the recompute: the head and cross-entropy draw no random numbers
    losses = [
        torch.utils.checkpoint.checkpoint(
            _chunk_loss, model, part, target, count, use_reentrant=False, preserve_rng_state=False
        )
        for part, target in zip(flat.split(sizes), shifted.split(sizes), strict=True)
    ]
    return torch.stack(losses).sum()


def _chunk_loss(
    model: PreTrainedModel, hidden: torch.Tensor, target: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """One chunk's summed loss over ``count``, through the model's own loss function (compiled as the "loss"
    region under regional compile)."""
    logits = _logits(model, hidden)
    return model.loss_function(
        logits=logits, labels=None, shift_labels=target, vocab_size=logits.shape[-1], num_items_in_batch=count
    )


def _logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's logits, soft-capped as Gemma 2 caps them (``final_logit_softcapping``)."""
    if (head := embeddings(model)[1]) is None:
        raise UsageError(f"--loss chunked runs a causal LM's head: {type(model).__name__} has none")
    logits = head(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits
