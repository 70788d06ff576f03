"""A family's fitted patterns: each point of each segment as a polynomial in micro batch and sequence length.

Run: ``fit_patterns({(b, s): trace_shape(...), ...}, layers=3)`` (``trace.traced_patterns`` does, for ``forecast``).

Every segment is traced at several (micro batch b, sequence s) shapes (``LINEAR``, and ``FAMILIES`` where those
do not fit) and each of its points is fitted exactly as bytes = c · (1, b, s, b·s, s², b·s²) (micro batch 1
separately, as c · (1, s, s²)): tensor sizes are such polynomials (s² from eager attention). A 4-layer copy is
traced too (at one shape, and at the others only where it differs from the 3-layer one): where the edge segments
(embedding, head, loss, the gap between micro-steps) differ between the two, the difference is what each layer
leaves to them, such as the bf16 weight copies autocast keeps for a recomputed layer until the forward's autocast
region ends, and ``timeline`` counts it once per layer of the full model (``with_per_layer``). The integer
coefficients are cached, one entry per family (``cache_key.FamilyKey``), so later forecasts need no tracing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ljperf.forecast.segments import RawTrace, SegmentKey, TraceError, split_segments

FAMILIES = {
    "b1": ((1, 32), (1, 64), (1, 96), (1, 128)),
    "bn": ((2, 32), (3, 32), (4, 32), (2, 64), (3, 64), (2, 96), (3, 96)),
}
"""Shapes traced per family. Micro batch 1 is its own family: some copies (``.contiguous()``) vanish at b=1.
Each family has one shape more than coefficients, so every fit is also checked."""
LINEAR = {
    "b1": ((1, 32), (1, 64), (1, 96)),
    "bn": ((2, 32), (3, 32), (2, 64), (3, 64), (4, 96)),
}
"""Shapes traced first per family: where no tensor grows with the square of the sequence (SDPA's attention; eager
attention's scores do), bytes are c · (1, b, s, b·s) (micro batch 1: c · (1, s)), which these fit with one shape
over, a third sequence length and a third micro batch that a square of either would miss. Only where they do not
fit is the family traced at its ``FAMILIES`` shapes."""


def family(micro_batch: int) -> str:
    return "b1" if micro_batch == 1 else "bn"


def family_shapes(name: str, *, seq_offset: int = 0, linear: bool = False) -> tuple[tuple[int, int], ...]:
    """The shapes of family ``name`` (``linear``: those traced first, ``LINEAR``), their sequence lengths
    ``seq_offset`` longer (``trace.windowed``)."""
    return tuple((b, s + seq_offset) for b, s in (LINEAR if linear else FAMILIES)[name])


def monomials(b: int, s: int) -> tuple[int, ...]:
    """The terms tensor sizes are made of; at b=1 the b-terms coincide, so that family keeps (1, s, s²)."""
    return (1, s, s * s) if b == 1 else (1, b, s, b * s, s * s, b * s * s)


@dataclass(frozen=True)
class Patterns:
    """Fitted segment patterns of one shape family: rows of integer coefficients over ``monomials(b, s)``."""

    segments: dict[str, list[list[int]]]
    """``"<segment>@<micro>"`` → one coefficient row per timeline point (first = start, last = end), as the
    ``trace.TRACE_LAYERS``-deep copy runs them."""
    per_layer: dict[str, list[list[int]]]
    """Edge segment → what each layer adds to its points (rows as in ``segments``); absent where nothing."""
    cuda_differs: bool = False
    """The traces met something CUDA runs otherwise (``RawTrace.cuda_differs``)."""
    divisor: int = 1
    """The coefficients are of ``divisor`` × bytes (``--loss chunked``: × ``LOSS_CHUNKS``, a chunk's tokens are
    a fraction of b·s; ``--tp``: a rank's share of a sequence-parallel tensor has
    bytes per token that are fractions of tp, such as 4 / 8 for one fp32 value a token at ``--tp 8``)."""
    seq_offset: int = 0
    """The polynomials are in the sequence length minus ``seq_offset``, the shapes' shift (``family_shapes``): so
    fitted, shapes thousands of tokens long are as well conditioned as the usual ones."""
    _memo: dict[tuple, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    """``points`` already evaluated, by (segment, b, s, per layer): a search forecasts thousands of recipes at a
    few shapes."""
    _evaluated: dict[tuple[int, int], dict[SegmentKey, tuple[int, int]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """``evaluate`` by (b, s)."""

    def entry(self) -> dict:
        """The fields a cache entry holds."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def segment_keys(self) -> list[SegmentKey]:
        return [SegmentKey.parse(name) for name in self.segments]

    def shares(self, key: SegmentKey) -> bool:
        """Whether each layer adds to the points of segment ``key`` (an edge's ``per_layer``)."""
        return key.cache_name in self.per_layer

    def points(self, key: SegmentKey, b: int, s: int, *, per_layer: bool = False) -> list[int]:
        """The points of segment ``key`` at micro batch ``b`` and sequence ``s`` (of its per-layer share)."""
        memo_key = (key.cache_name, b, s, per_layer)
        if memo_key not in self._memo:
            rows = self.per_layer[key.cache_name] if per_layer else self.segments[key.cache_name]
            m = monomials(b, s - self.seq_offset)
            self._memo[memo_key] = [sum(c * x for c, x in zip(row, m, strict=True)) // self.divisor for row in rows]
        return self._memo[memo_key]

    def evaluate(self, b: int, s: int) -> dict[SegmentKey, tuple[int, int]]:
        """``segment → (peak above its start, end minus start)`` at micro batch ``b`` and sequence ``s``."""
        if (b, s) not in self._evaluated:
            self._evaluated[b, s] = {key: peak_and_net(self.points(key, b, s)) for key in self.segment_keys()}
        return self._evaluated[b, s]


def peak_and_net(values: list[int]) -> tuple[int, int]:
    """(peak above the start, end minus start) of a segment's points."""
    return max(values), values[-1]


def fit_patterns(
    traces: dict[tuple[int, int], RawTrace],
    *,
    layers: int,
    divisor: int = 1,
    seq_offset: int = 0,
    linear: bool = False,
) -> dict[str, list[list[int]]]:
    """Fit every point of every segment, times ``divisor``, exactly over the traced shapes, as polynomials in the
    sequence length minus ``seq_offset`` (``linear``: without its squares, ``LINEAR``; the rows still hold every
    monomial, those zero); raises TraceError when not exact."""
    shapes = list(traces)
    split = {shape: split_segments(raw, layers=layers) for shape, raw in traces.items()}
    terms = [monomials(b, s - seq_offset) for b, s in shapes]
    used = len(terms[0]) - (1 if shapes[0][0] == 1 else 2) if linear else len(terms[0])
    x = torch.tensor([row[:used] for row in terms], dtype=torch.float64)
    fitted: dict[str, list[list[int]]] = {}
    for name in split[shapes[0]]:
        lengths = {len(split[shape][name]) for shape in shapes}
        if len(lengths) != 1:
            raise TraceError(f"segment {name} has a shape-dependent op sequence ({sorted(lengths)} points)")
        y = torch.tensor([split[shape][name] for shape in shapes], dtype=torch.float64)
        rows = _exact_fit(x, y * divisor, name)
        fitted[name] = [row + [0] * (len(terms[0]) - used) for row in rows]
    return fitted


def with_per_layer(
    reference: dict[str, list[list[int]]],
    deeper: dict[str, list[list[int]]],
    *,
    cuda_differs: bool = False,
    divisor: int = 1,
    seq_offset: int = 0,
) -> Patterns:
    """Patterns from the fits of the ``trace.TRACE_LAYERS``- and ``trace.SLOPE_LAYERS``-deep copies: the layers'
    segments must agree (the composition repeats them), and an edge segment's difference is its per-layer share."""
    per_layer = {}
    for name, rows in reference.items():
        other = deeper[name]
        if len(other) != len(rows):
            raise TraceError(f"segment {name} has a depth-dependent op sequence ({len(rows)}, {len(other)} points)")
        slope = [[d - r for r, d in zip(row, deep, strict=True)] for row, deep in zip(rows, other, strict=True)]
        if not any(any(row) for row in slope):
            continue
        if not SegmentKey.parse(name).segment.edge:
            raise TraceError(f"decoder layer segment {name} depends on the model's depth")
        per_layer[name] = slope
    return Patterns(
        segments=reference, per_layer=per_layer, cuda_differs=cuda_differs, divisor=divisor, seq_offset=seq_offset
    )


def _exact_fit(x: torch.Tensor, y: torch.Tensor, name: str) -> list[list[int]]:
    coef = torch.linalg.lstsq(x, y).solution.round()
    if (x @ coef - y).abs().max() > 0.5:
        raise TraceError(f"segment {name}: bytes are not a polynomial in batch and sequence length")
    return coef.T.to(torch.int64).tolist()
