"""Compose traced block patterns into one rank's training step and take the peak.

Use: ``compose(spec, recipe, patterns)`` (``forecast.api.forecast`` calls it with the traced patterns).

The traced patterns are evaluated at the recipe's shape and keyed by segment (``trace.SegmentKey``): each decoder
layer takes its own recompute mode's and kind's, the edge segments (embedding, head and loss, the gap between
micro-steps) count what each layer leaves to them. Each kind of rank's step is walked (``walk.walk_step``) over
its engine's sharding (``sharding.rank_shardings``), and the highest rank's peak is the forecast.
"""

from __future__ import annotations

from collections import Counter

from ljperf.forecast.blocks import block_params, recipe_blocks
from ljperf.forecast.patterns import Patterns, peak_and_net
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.forecast.segments import SegmentKey, TraceError
from ljperf.forecast.sharding import rank_shardings
from ljperf.forecast.trace import TRACE_LAYERS, reference_kind
from ljperf.forecast.walk import Segments, Walk, walk_step
from ljperf.models.spec import ModelSpec


def edge_values(
    patterns: dict[str, Patterns], modes: tuple[str, ...], b: int, s: int
) -> dict[SegmentKey, tuple[int, int]]:
    """The edge segments of ``modes[0]``'s trace, with what each layer leaves to them (``Patterns.per_layer``)
    counted for the plan's layers in their own modes instead of the traced copy's ``TRACE_LAYERS``."""
    first = patterns[modes[0]]
    counts = Counter(modes)
    counts[modes[0]] -= TRACE_LAYERS
    out = {}
    for key in first.segment_keys():
        if not key.segment.edge:
            continue
        values = first.points(key, b, s)
        for mode, count in counts.items():
            if count and patterns[mode].shares(key):
                share = patterns[mode].points(key, b, s, per_layer=True)
                if len(share) != len(values):
                    raise TraceError(
                        f"segment {key.cache_name} runs other ops in recompute modes {modes[0]} and {mode}"
                    )
                values = [v + count * d for v, d in zip(values, share, strict=True)]
        out[key] = peak_and_net(values)
    return out


def highest_walk(
    spec: ModelSpec, recipe: Recipe, patterns: dict[tuple[str, int], Patterns], *, record: bool = False
) -> Walk:
    """The walk of the step of ``recipe``'s rank with the highest peak, over the traced patterns of each recompute
    mode and kind of layer (``(mode, kind)``; see ``trace.layer_picks``); ``record``: with every point visited."""
    modes = recipe.layer_modes(spec.layers)
    if recipe.stage is not None:  # a pipeline stage walks its own layers
        modes = modes[recipe.stage_layers.start : recipe.stage_layers.stop]
    b, s = recipe.micro_batch, recipe.seq_len
    values = {key: pats.evaluate(b, s) for key, pats in patterns.items()}
    blocks = recipe_blocks(spec, recipe)
    ref = reference_kind(block_params(spec, tp=recipe.tp).layer_kinds)
    edges = edge_values({mode: pats for (mode, kind), pats in patterns.items() if kind == ref}, modes, b, s)
    # a middle layer walks its own kind's copy; the first and last are alike in every copy
    kinds = [ref, *blocks.layer_kinds[1:-1], ref][: blocks.layers]
    layers: tuple[Segments, ...] = tuple(values[mode, kind] for mode, kind in zip(modes, kinds, strict=True))
    # a pipeline stage's hidden states, as one tensor-parallel rank holds them (its share of the sequence)
    act_bytes = 2 if recipe.trace_precision == "bf16-params" else 4
    boundary = b * s * spec.hidden * act_bytes // recipe.tp if recipe.stage is not None else 0
    # the last stage's logits (the LM head's output dtype), the vocabulary's shard under --tp (loss parallel);
    # the chunked loss's stage gives its loss, and its head's input is kept in the traced loss already
    logits = b * s * spec.vocab * (4 if recipe.precision == "fp32" else 2) // recipe.tp
    if recipe.loss == "chunked":
        logits = 0
    ends = {"boundary": boundary, "kept_output": logits}
    walks = [
        walk_step(recipe, shard, blocks=blocks, layers=layers, edges=edges, record=record, **ends)
        for shard in rank_shardings(spec, recipe)
    ]
    return max(walks, key=lambda w: w.peak)


def compose(spec: ModelSpec, recipe: Recipe, patterns: dict[tuple[str, int], Patterns]) -> Forecast:
    """The forecast of ``recipe`` from the traced patterns of each recompute mode it uses and each kind of layer
    (``(mode, kind)``; see ``trace.layer_picks``): the highest rank's."""
    walk = highest_walk(spec, recipe, patterns)
    parts = dict(walk.peak_parts or {})
    parts["temporaries"] = walk.peak - sum(parts.values())
    return Forecast(
        peak_allocated_bytes=walk.peak,
        peak_reserved_bytes=None,
        context_bytes=0,
        breakdown={k: v for k, v in parts.items() if v or k in ("parameters", "activations")},
        phase=walk.phase,
        source="traced",
    )
