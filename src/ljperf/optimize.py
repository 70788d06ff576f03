"""Optimizations applied to the model before its engine wraps or shards it, in torchtitan's fixed order:
activation checkpointing → compile → (engine) shard/wrap.

Every engine calls ``apply_optimizations(model, run)`` once, on the HF model (meta or materialized):
``apply_checkpoint``, then ``compile.apply_compile``.
"""

from __future__ import annotations

import torch

from ljperf.checkpoint import parse_recompute
from ljperf.compile import apply_compile
from ljperf.runtime import RunContext


def apply_optimizations(model: torch.nn.Module, run: RunContext) -> torch.nn.Module:
    """Apply the run's optimizations in order; returns the model to wrap/shard."""
    apply_checkpoint(model, run)
    return apply_compile(model, run)


def apply_checkpoint(model: torch.nn.Module, run: RunContext) -> None:
    """The run's ``--recompute`` plan on the model's decoder layers (``auto``: solved here unless the caller did)."""
    if run.optim.recompute == "none":
        return
    from ljperf.checkpoint import fixed_plan
    from ljperf.checkpoint.apply import apply_plan
    from ljperf.checkpoint.solver import prepare_run

    if run.optim.recompute == "auto":  # not resolved by the caller (the benchmark resolves it first)
        prepare_run(run)
    apply_plan(model, fixed_plan(parse_recompute(run.optim.recompute), run.model.layers))
