"""The step-time model under ``--pp``: the whole model's step on one data-parallel × tensor-parallel rank, cut to
the pipeline rank that takes longest, with the schedule's bubble and the hidden states sent between stages.

Run: ``pipelined(parts, pipe, times=..., seconds=...)`` in ``step_time.predict`` when ``StepWork.pipeline`` is set.

A pipeline step of ``m`` micro-batches over ``p`` ranks of ``V`` stages each runs ``V·m + p − 1`` stage slots of
``t / V`` (``t``: the slowest rank's compute for one micro-batch), so its compute is ``m·t`` and its bubble
``(p − 1)·t / V``: the fraction ``forecast.pipeline.bubble_fraction``. Each micro-batch crosses each stage boundary
twice (its hidden states forward, their gradient back); the sends of the fill and the drain are on the critical
path, the others overlap the stages' compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ljperf.speed.collectives import Collective

SCALED = ("forward", "backward", "recompute", "exposed_comm")
"""Breakdown entries of per-micro-batch compute (and the waits inside it): the slowest rank's share of them."""
BY_PARAMETERS = ("optimizer", "all_gather", "reduce_scatter", "all_reduce", "tp")
"""Entries that follow a rank's parameters (its layers' share; tensor parallel's follow its layers too)."""


@dataclass(frozen=True, kw_only=True)
class PipelineWork:
    """What a pipeline adds to a step: the layers of each pipeline rank and the size of a boundary's send."""

    layers_per_rank: tuple[int, ...]
    """Decoder layers each pipeline rank holds (over its stages)."""
    stages_per_rank: int
    microbatches: int
    send: Collective
    """One micro-batch's hidden states over one stage boundary (the pipeline ranks are ``stride`` ranks apart)."""


@dataclass(frozen=True, kw_only=True)
class LayerSeconds:
    """One micro-batch's compute of the whole model on one rank: per decoder layer and the rest (embedding, final
    norm, LM head and loss: on the first and the last stage; counted on the last, where the LM head is)."""

    layer: float
    rest: float


def slowest_share(pipe: PipelineWork, per: LayerSeconds) -> tuple[float, float, float]:
    """(compute share, parameter share, seconds a micro-batch) of the slowest pipeline rank."""
    layers = sum(pipe.layers_per_rank)
    whole = layers * per.layer + per.rest
    last = len(pipe.layers_per_rank) - 1
    each = [n * per.layer + (per.rest if r == last else 0.0) for r, n in enumerate(pipe.layers_per_rank)]
    slowest = max(range(len(each)), key=lambda r: each[r])
    return each[slowest] / whole, pipe.layers_per_rank[slowest] / layers, each[slowest]


def pipelined(
    parts: dict[str, float], pipe: PipelineWork, *, per: LayerSeconds, seconds: Callable[[Collective], float]
) -> dict[str, float]:
    """``parts`` (the whole model's breakdown on one rank, ``step_time.BREAKDOWN``) for the slowest pipeline rank:
    its share of the compute and of the parameters' work, the bubble, and the pipeline's sends."""
    compute_share, param_share, slot = slowest_share(pipe, per)
    out = dict(parts)
    for key in SCALED:
        out[key] = parts[key] * compute_share
    for key in BY_PARAMETERS:
        out[key] = parts[key] * param_share
    p, v, m = len(pipe.layers_per_rank), pipe.stages_per_rank, pipe.microbatches
    out["bubble"] = (p - 1) * slot / v
    one = seconds(pipe.send)
    out["pp_send"] = 2 * m * v * one
    out["exposed_comm"] += 2 * (p - 1) * one  # the fill's sends forward, the drain's back
    return out
