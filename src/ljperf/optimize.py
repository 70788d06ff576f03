"""Optimizations applied to the model before its engine wraps or shards it, in torchtitan's fixed order:
activation checkpointing → compile → (engine) shard/wrap.

Every engine calls ``apply_optimizations`` once, on the HF model (meta or materialized).
"""

from __future__ import annotations

import torch

from ljperf.compile import apply_compile
from ljperf.runtime import RunContext


def apply_optimizations(model: torch.nn.Module, run: RunContext) -> torch.nn.Module:
    """Apply the run's optimizations in order; returns the model to wrap/shard."""
    model = apply_compile(model, run)
    return model
