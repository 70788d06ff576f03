"""How much of a step's communication each engine leaves exposed: what its schedule cannot hide behind compute.

Run: ``exposed(traffic, seconds=..., times=StepTimes(...), overlap=1.0)`` → seconds exposed by phase. Each engine's
schedule, not one factor: FSDP2 and ZeRO-3 gather the next layer while this one computes (ZeRO-3 as much as its
prefetch bucket holds) and reduce-scatter a layer's gradients while the next one runs backward; DDP all-reduces
its buckets as backward fills them (the last bucket waits for the end of backward); ZeRO-1/2 reduce their
buckets in backward's way unless ``overlap_comm``, and gather the updated parameters after the step; tensor
parallel's activation collectives sit on the critical path. ``overlap`` is the share of a compute window a
collective can use (1 on a GPU: NCCL's own stream).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ljperf.speed.collectives import Collective
from ljperf.speed.traffic import Traffic

Seconds = Callable[[Collective], float]


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    """Compute seconds of one micro-step, by block."""

    layer_forward: tuple[float, ...]
    """Each decoder layer's forward."""
    layer_backward: tuple[float, ...]
    """Each layer's backward with its recompute (which runs just before it)."""
    rest_forward: float
    rest_backward: float
    micro_steps: int


def _total(collectives: tuple[Collective, ...], seconds: Seconds) -> float:
    return sum(seconds(c) for c in collectives)


def _layered(traffic: Traffic, times: StepTimes, seconds: Seconds, overlap: float) -> tuple[float, float]:
    """(forward, backward) exposed of one micro-step of FSDP2 or ZeRO-3: the root's and the first layer's gather
    wait; layer i's gather hides behind layer i-1's forward as far as it is prefetched; in backward a layer's
    gather (when resharded) and the previous layer's reduce-scatter hide behind its backward; the last layer's
    reduce-scatter and the root's wait for nothing to run beside them."""
    gather = seconds(traffic.layer_gather) if traffic.layer_gather else 0.0
    ahead = traffic.prefetch * gather  # the rest of a gather is issued when the layer starts
    root = seconds(traffic.root_gather) if traffic.root_gather else 0.0
    forward = root + gather
    for window in times.layer_forward[:-1]:
        forward += gather - ahead + max(0.0, ahead - overlap * window)
    reduce = _total(traffic.layer_reduce, seconds)
    back_gather = ahead if traffic.gather_in_backward else 0.0
    backward = root if traffic.gather_in_backward else 0.0
    backward += max(0.0, back_gather - overlap * times.rest_backward) + (gather - ahead) * traffic.gather_in_backward
    windows = times.layer_backward[::-1]  # backward runs the last layer first
    for i, window in enumerate(windows):
        hide = (back_gather if i + 1 < len(windows) else 0.0) + (reduce if i > 0 else 0.0)
        late = (gather - ahead) * traffic.gather_in_backward if i + 1 < len(windows) else 0.0
        backward += late + max(0.0, hide - overlap * window)
    backward += reduce + _total(traffic.root_reduce, seconds)
    return forward, backward


def _bucketed(traffic: Traffic, times: StepTimes, seconds: Seconds, overlap: float) -> float:
    """Backward's exposed bucket reduction, per step: k buckets of total C over a backward of B seconds, filled
    evenly, on one stream: the last waits for backward's end, so max(C/k, C - B(k-1)/k); in backward's way
    (ZeRO-1/2 without ``overlap_comm``) all of C."""
    total = _total(traffic.bucketed, seconds)
    if not total:
        return 0.0
    reductions = times.micro_steps if traffic.bucketed_every_micro_step else 1
    if not traffic.overlapped_buckets:
        return reductions * total
    calls = max(sum(c.calls for c in traffic.bucketed), 1)
    window = overlap * (sum(times.layer_backward) + times.rest_backward)
    return reductions * max(total / calls, total - window * (calls - 1) / calls)


def exposed(traffic: Traffic, *, seconds: Seconds, times: StepTimes, overlap: float) -> dict[str, float]:
    """Seconds of communication the step waits for, by the phase that waits: forward, backward, optimizer."""
    layers = len(times.layer_forward)
    tp_forward = layers * _total(traffic.layer_tp_forward, seconds) + _total(traffic.root_tp, seconds) / 2
    tp_backward = layers * _total(traffic.layer_tp_backward, seconds) + _total(traffic.root_tp, seconds) / 2
    forward, backward = _layered(traffic, times, seconds, overlap) if traffic.style in ("fsdp", "zero3") else (0, 0)
    return {
        "forward": times.micro_steps * (forward + tp_forward),
        "backward": times.micro_steps * (backward + tp_backward) + _bucketed(traffic, times, seconds, overlap),
        "optimizer": _total(traffic.after_step, seconds),
    }


def totals(traffic: Traffic, *, seconds: Seconds, layers: int, micro_steps: int) -> dict[str, float]:
    """Seconds of each collective kind in a step, exposed or not (``collectives.KINDS``)."""
    out: dict[str, float] = {}

    def add(collectives: tuple[Collective, ...], times: int) -> None:
        for c in collectives:
            out[c.what] = out.get(c.what, 0.0) + times * seconds(c)

    gather = (traffic.layer_gather,) if traffic.layer_gather else ()
    root = (traffic.root_gather,) if traffic.root_gather else ()
    passes = 2 if traffic.gather_in_backward else 1
    add(gather, micro_steps * layers * passes)
    add(root, micro_steps * passes)
    add(traffic.layer_reduce, micro_steps * layers)
    add(traffic.root_reduce, micro_steps)
    add(traffic.layer_tp_forward + traffic.layer_tp_backward, micro_steps * layers)
    add(traffic.root_tp, micro_steps)
    add(traffic.bucketed, micro_steps if traffic.bucketed_every_micro_step else 1)
    add(traffic.after_step, 1)
    return out
