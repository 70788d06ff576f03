"""How each engine holds the model states on one rank, and what it gathers, buffers and reduces around each block.

Use: ``engine_sharding(spec, recipe)`` (one rank), ``rank_shardings(spec, recipe)`` (each kind of rank); the
shape they fill in is ``base.Sharding``, and each engine's module sizes it: ``ddp`` (torch), ``fsdp`` (FSDP2),
``zero`` (DeepSpeed ZeRO-1/2/3).
"""

from __future__ import annotations

from collections.abc import Callable

from ljperf.forecast.recipe import Recipe
from ljperf.forecast.sharding import ddp, fsdp, zero
from ljperf.forecast.sharding.base import Sharding
from ljperf.models.spec import ModelSpec

__all__ = ["Sharding", "engine_sharding", "rank_shardings"]

SHARDINGS: dict[str, Callable[[ModelSpec, Recipe], Sharding]] = {
    "torch": ddp.ddp_sharding,
    "fsdp": fsdp.fsdp_sharding,
    "deepspeed": zero.zero_sharding,
}
"""Each engine's sharding (ZeRO-2's: the rank with the largest gradient partition)."""

BY_RANK: dict[str, Callable[[ModelSpec, Recipe], list[Sharding]]] = {"deepspeed": zero.rank_shardings}
"""Engines whose ranks can hold different shardings: one of each kind; the others hold the same on every rank."""


def engine_sharding(spec: ModelSpec, recipe: Recipe) -> Sharding:
    """``recipe``'s engine's sharding of ``spec`` on one rank; FSDP2 with tensor parallel alone (``--tp`` the world)
    shards nothing more: replicated states of the tensor-parallel shards, as one device holds them."""
    if recipe.engine == "fsdp" and recipe.mesh.tp_alone:
        return ddp.ddp_sharding(spec, recipe)
    return SHARDINGS[recipe.engine](spec, recipe)


def rank_shardings(spec: ModelSpec, recipe: Recipe) -> list[Sharding]:
    """``recipe``'s engine's sharding of ``spec`` as each kind of rank holds it."""
    by_rank = BY_RANK.get(recipe.engine)
    return by_rank(spec, recipe) if by_rank else [engine_sharding(spec, recipe)]
