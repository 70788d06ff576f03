"""Optimizations applied to the model before its engine wraps or shards it, in torchtitan's fixed order:
activation checkpointing → compile → (engine) shard/wrap.

Every engine calls ``apply_optimizations`` once, on the HF model (meta or materialized).
"""

from __future__ import annotations

import torch

from ljperf.checkpoint import parse_recompute
from ljperf.compile import apply_compile
from ljperf.runtime import RunContext


def apply_optimizations(model: torch.nn.Module, run: RunContext) -> torch.nn.Module:
    """Apply the run's optimizations in order; returns the model to wrap/shard."""
    if run.optim.recompute != "none":
        from ljperf.checkpoint.apply import apply_plan, fixed_plan
        from ljperf.checkpoint.solver import prepare_run

        if run.optim.recompute == "auto":  # not resolved by the caller (the benchmark resolves it first)
            prepare_run(run)
        apply_plan(model, fixed_plan(parse_recompute(run.optim.recompute), run.model.layers))
    model = apply_compile(model, run)
    return model
