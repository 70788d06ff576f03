"""Pipeline stages of an HF decoder-only causal LM, split by layers: the embedding in the first stage, the final
norm, LM head and loss in the last, each stage the same HF code on a slice of the decoder layers.

Run: ``stage = split_stage(model, layers=range(0, 2), first=True, last=False)`` on the whole model (meta or
materialized); ``stage(tokens)`` gives the hidden states the next stage takes (the last stage gives logits, which
``next_token_loss`` scores against the tokens; given ``labels``, ``--loss chunked``'s loss itself).
``models.pipeline_split`` says which layers a stage holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from transformers import PreTrainedModel

from ljperf.core.phases import phase
from ljperf.models.loss import chunked_loss


class DecoderStage(torch.nn.Module):
    """One pipeline stage: token ids (first stage) or hidden states in, hidden states or (last stage) logits out.
    ``model`` is the HF causal LM cut down to the stage's modules (``split_stage``)."""

    def __init__(self, model: PreTrainedModel, *, first: bool, last: bool):
        super().__init__()
        self.model, self.first, self.last = model, first, last

    tp_mesh: DeviceMesh | None = None
    """The tensor-parallel mesh the stage's layers are split over (``--tp``): the hidden states a stage passes are
    its rank's shard of the sequence, a DTensor again in the next stage."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``labels`` (the last stage, ``--loss chunked``): the chunked loss of the micro-batch, run inside the
        stage's forward, where FSDP2 holds the head gathered, instead of the whole logits."""
        decoder = self.model.get_decoder()
        if not self.first and self.tp_mesh is not None:
            x = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False)
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        with phase("forward"):  # the schedule interleaves the stages' forwards with backwards and transfers
            hidden = decoder(**given, use_cache=False).last_hidden_state
            if self.last and labels is not None:
                return chunked_loss(self.model, hidden, labels)
            if self.last:
                head = self.model.get_output_embeddings()
                assert head is not None  # check_pipeline_model refused a model without an LM head
                return head(hidden)
        return hidden.to_local() if isinstance(hidden, DTensor) else hidden


def split_stage(model: PreTrainedModel, *, layers: range, first: bool, last: bool) -> DecoderStage:
    """The stage of ``model`` holding decoder ``layers``, the embedding when ``first``, the final norm and LM head
    when ``last``. The modules are ``model``'s own, not copies: their parameter names (and so their initial
    values, ``models.build.init_value``) stay the whole model's; ``model`` is cut down in place."""
    decoder: Any = model.get_decoder()  # HF decoders: duck-typed layers, embed_tokens, norm
    decoder.layers = torch.nn.ModuleList([decoder.layers[i] for i in layers])
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = torch.nn.Identity()
        model.lm_head = torch.nn.Identity()
    return DecoderStage(model, first=first, last=last)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of ``logits`` against ``tokens`` (the inputs, shifted), as HF's causal-LM
    loss computes it: fp32 logits, the labels shifted (not the logits: a slice of them is a copy, and its backward
    a logits-sized buffer more), the last position ignored."""
    labels = torch.nn.functional.pad(tokens, (0, 1), value=-100)[:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
