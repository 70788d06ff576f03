"""Synthetic training data: a seeded, Zipf-distributed token stream, identical on every run and engine.

Uniform random tokens cannot be learned (their loss starts at its optimum, ln V); Zipf-distributed
tokens, like natural text, give a loss that falls, so "the loss decreases" is a meaningful check.
Step ``s`` draws one global batch of shape (grad_accum, world * micro_batch, seq_len); rank ``r``
takes its rows, so any split of the same global batch over ranks trains on the same tokens.
"""

from __future__ import annotations

import torch


class SyntheticTokens:
    """Global batches of token ids; ``micro_batches(step, rank)`` gives one rank's share."""

    def __init__(self, *, vocab: int, seq_len: int, micro_batch: int, grad_accum: int, world: int, seed: int):
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.world = world
        self.seed = seed
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        self._probs = (1.0 / ranks) / (1.0 / ranks).sum()

    def micro_batches(self, step: int, rank: int, device: torch.device) -> list[torch.Tensor]:
        """The ``grad_accum`` micro-batches (each micro_batch × seq_len, int64) of ``rank`` at ``step``."""
        gen = torch.Generator().manual_seed((self.seed * 100_003 + step) % 2**63)
        rows = self.world * self.micro_batch
        n = self.grad_accum * rows * self.seq_len
        tokens = torch.multinomial(self._probs, n, replacement=True, generator=gen)
        tokens = tokens.view(self.grad_accum, rows, self.seq_len)
        mine = tokens[:, rank * self.micro_batch : (rank + 1) * self.micro_batch]
        return [mb.to(device, non_blocking=True) for mb in mine.unbind(0)]
