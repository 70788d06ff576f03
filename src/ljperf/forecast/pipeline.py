"""What each pipeline stage costs in memory, for the split the fsdp engine runs under ``--pp`` and the forecast of
each stage: bytes per decoder layer (its parameters, gradients and AdamW moments) and what the first stage (the
embedding) and the last (the final norm, LM head and the logits of a micro-batch) add.

Run: ``layers, ends = stage_costs(resolve(name="llama3-8b"), micro_batch=1, seq_len=8192)``, then
``models.pipeline_split.balanced_split(layers, stages=4, ends=ends)``.
"""

from __future__ import annotations

from ljperf.forecast.blocks import block_params
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
