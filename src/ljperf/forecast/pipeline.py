"""What each pipeline stage costs in memory, for the split the fsdp engine runs under ``--pp`` and the forecast of
each stage: bytes per decoder layer (its parameters, gradients and AdamW moments) and what the first stage (the
embedding) and the last (the final norm, LM head and the logits of a micro-batch) add.

Run: ``layers, ends = stage_costs(resolve(name="llama3-8b"), micro_batch=1, seq_len=8192)``, then
``models.pipeline_split.balanced_split(layers, stages=4, ends=ends)``.
"""

from __future__ import annotations

import functools

from ljperf.forecast.blocks import block_params
from ljperf.forecast.recipe import Recipe
from ljperf.models.pipeline_split import balanced_split
from ljperf.models.spec import ModelSpec

STATE_BYTES = 16
"""Bytes a parameter holds through a step in fp32 AdamW training: the weight, its gradient and two moments (the
split needs their ratios between stages, which sharding over the stages' data-parallel ranks keeps)."""
LOGIT_BYTES = 3 * 4
"""Bytes per logit at the last stage's peak: fp32 logits, their gradient and the loss's temporary."""


def stage_costs(spec: ModelSpec, *, micro_batch: int, seq_len: int) -> tuple[list[float], tuple[float, float]]:
    """Bytes of each decoder layer, and what the first and the last stage add (``balanced_split``'s ``ends``)."""
    blocks = block_params(spec)
    layers = [float(n * STATE_BYTES) for n in blocks.layer_sizes]
    logits = micro_batch * seq_len * spec.vocab * LOGIT_BYTES
    return layers, (float(blocks.pre * STATE_BYTES), float(blocks.post * STATE_BYTES + logits))


def bubble_fraction(*, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a pipeline step its ranks sit idle, filling and draining: (p − 1) / (V·m + p − 1) for ``pp``
    ranks, ``microbatches`` m and ``stages_per_rank`` V (GPipe and 1F1B alike; interleaving divides it by V)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def in_flight(*, schedule: str, stage: int, pp: int, microbatches: int) -> int:
    """Micro-batches whose activations pipeline rank ``stage`` holds at its peak: GPipe all of them, 1F1B at most
    ``pp - stage`` (the warm-up forwards before its first backward)."""
    return microbatches if schedule == "gpipe" else min(microbatches, pp - stage)


def pipeline_split(spec: ModelSpec, recipe: Recipe) -> tuple[int, ...]:
    """Decoder layers per stage: ``recipe.pp_split`` (``--pp-split``), else the split of ``stage_costs``
    balanced, the one the fsdp engine runs."""
    if recipe.pp_split:
        return recipe.pp_split
    layers, ends = stage_costs(spec, micro_batch=recipe.micro_batch, seq_len=recipe.seq_len)
    return _balanced(tuple(layers), stages=recipe.stages, ends=ends)


@functools.lru_cache(maxsize=1024)
def _balanced(layers: tuple[float, ...], *, stages: int, ends: tuple[float, float]) -> tuple[int, ...]:
    """``balanced_split``, kept: a search forecasts and prices thousands of pipeline recipes of a few splits."""
    return tuple(balanced_split(list(layers), stages=stages, ends=ends))
