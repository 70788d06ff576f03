"""The torch engine's sharding: one device, or DDP's replicas.

Use: ``ddp_sharding(spec, recipe)`` (``sharding.engine_sharding`` picks it for ``engine="torch"``).
"""

from __future__ import annotations

from ljperf.forecast.recipe import Recipe
from ljperf.forecast.sharding.base import Sharding, Sizes
from ljperf.models.spec import ModelSpec


def ddp_sharding(spec: ModelSpec, recipe: Recipe) -> Sharding:
    """Replicated states (the weights the optimizer steps, AdamW's two moments), plus DDP's gradient buckets on
    more than one rank (one gradient-sized buffer, alive from construction); FSDP2's tensor parallel alone holds its
    shards so, its embedding's gradient whole until the step."""
    size = Sizes.of(spec, recipe)
    p = size.weights
    return Sharding(
        params=p,
        grads=p,
        optimizer=2 * p + size.step_scalars,
        comm_buffers=p if size.world > 1 else 0,
        embedding_grad_shares=recipe.tp,
    )
