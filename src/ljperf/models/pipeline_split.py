"""Which decoder layers each pipeline stage holds: ``--pp-split`` read, or a split balanced by the forecast's
per-layer cost; no torch.

Run: ``balanced_split([1.0] * 32, stages=4, ends=(0.5, 2.0))`` → ``[9, 8, 8, 7]``: contiguous layer counts whose
largest stage (with the embedding on the first and the head and loss on the last) is smallest.
"""

from __future__ import annotations

from collections.abc import Sequence

from ljperf.core.errors import UsageError

PIPELINED = {"llama": "Llama", "qwen2": "Qwen 2", "qwen3": "Qwen 3", "mistral": "Mistral"}
"""Model types the splitter knows (model_type → name): ``model.embed_tokens``, ``model.layers``, ``model.norm``
and ``lm_head``, the decoder's forward taking ``inputs_embeds`` (the rotary embedding and causal mask are made in
every stage from the sequence, as the whole model makes them)."""


def check_pipelined(model_type: str) -> None:
    """``--pp`` needs a decoder laid out as Llama's: one line naming what runs otherwise."""
    if model_type not in PIPELINED:
        raise UsageError(
            f"--pp splits {', '.join(PIPELINED.values())} decoders (model.layers, embedding first, norm and LM head"
            f" last); model_type {model_type!r} is not one: run it without --pp"
        )


def stage_layers(counts: Sequence[int]) -> list[range]:
    """The decoder layers of each stage, from its layer count."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


def balanced_split(costs: Sequence[float], *, stages: int, ends: tuple[float, float] = (0.0, 0.0)) -> list[int]:
    """Layers per stage that balance ``costs`` (one per decoder layer: its forecast bytes or FLOPs), each stage at
    least one layer; ``ends``: the cost the first stage (embedding) and the last (norm, head, loss) add. The
    contiguous split whose largest stage is smallest (binary search over the bound, greedy fill)."""
    if not 1 <= stages <= len(costs):
        raise UsageError(f"--pp {stages} needs at least {stages} decoder layers (the model has {len(costs)})")
    lo, hi = max(costs) + max(ends), sum(costs) + sum(ends)
    for _ in range(100):
        bound = (lo + hi) / 2
        if _fits(costs, stages, ends, bound) is not None:
            hi = bound
        else:
            lo = bound
    counts = _fits(costs, stages, ends, hi)
    assert counts is not None
    return counts


def _fits(costs: Sequence[float], stages: int, ends: tuple[float, float], bound: float) -> list[int] | None:
    """``stages`` stages of at most ``bound`` each, filled greedily from the first (a stage closes when the next
    layer would pass the bound, or when the layers left are only enough for one a stage); None if they cannot."""
    counts: list[int] = []
    load, n = ends[0], 0
    for i, cost in enumerate(costs):
        extra = ends[1] if i == len(costs) - 1 else 0.0
        after = stages - len(counts) - 1  # stages still to open after the current one
        if n and (load + cost + extra > bound or len(costs) - i <= after):
            counts.append(n)
            load, n = 0.0, 0
        load, n = load + cost + extra, n + 1
        if load > bound or len(counts) >= stages:
            return None
    counts.append(n)
    return counts if len(counts) == stages else None


def parse_split(text: str, *, layers: int, stages: int) -> list[int]:
    """``--pp-split 10,12,10``: layers per stage; they must be ``stages`` counts of one or more adding to
    ``layers``."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--pp-split {text!r}: write the layers of each stage, e.g. 10,12,10") from None
    if len(counts) != stages or min(counts) < 1 or sum(counts) != layers:
        raise UsageError(
            f"--pp-split {text!r}: give {stages} counts of one or more (one per stage) adding to the model's"
            f" {layers} layers"
        )
    return counts
