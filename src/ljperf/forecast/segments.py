"""Attribution of a traced step's bytes to the model's blocks: marks at their boundaries, segments between marks.

Run: ``install_marks(model, timeline, state)`` before the traced step (``trace.trace_shape`` does), then
``split_segments(raw, layers=3)``. Module and tensor hooks mark the forward and backward of the embedding part
("pre"), of each decoder layer and of the norm/LM-head/loss part ("post"); the layer 0 / layer 1 / last layer
segments stand for the first, middle and last layer of the full-depth model, which ``timeline`` composes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ljperf.forecast.live_bytes import LiveBytesTimeline
from ljperf.models.layout import decoder_layers

if TYPE_CHECKING:
    from transformers.modeling_outputs import CausalLMOutputWithPast

MICRO_STEPS = 2
"""Micro-step 1 allocates the gradients; micro-step 2 (and every later one) accumulates into them."""


class SecondMicroStep(Exception):
    """Raised where a trace of the first micro-step only reaches the second one's start."""


class TraceError(RuntimeError):
    """The model could not be traced consistently; the forecast falls back to the analytic formula."""


@dataclass(frozen=True)
class RawTrace:
    """The timeline of one traced shape: points and (mark name, point index)."""

    points: list[int]
    marks: list[tuple[str, int]]
    cuda_differs: bool = False
    """An SDPA call took the math path or would take it on CUDA (``trace.cuda_runs_math``), or an op of
    ``trace.CUDA_FP32`` ran on a bf16 input under autocast: CUDA runs each otherwise (see ``trace``'s docstring)."""
    first_only: bool = False
    """Traced up to the second micro-step's start (its "fwd" mark): the first micro-step's segments only."""


def block_marks(layers: int) -> list[str]:
    """The block marks of one micro-step of a ``layers``-deep copy ("loss", set when the model returns, is
    ignored)."""
    forward = [mark for i in range(layers) for mark in (f"f{i}", f"f{i}e")]
    return ["fwd", *forward, "loss_grad", "post_g", *(f"b{i}" for i in reversed(range(layers))), "b0e", "bwd_end"]


def install_marks(model: torch.nn.Module, timeline: LiveBytesTimeline, state: dict) -> None:
    """Hooks on ``model`` that mark ``block_marks`` in ``timeline`` as each block starts and its backward ends,
    and "post_g" where the head's backward makes its first parameter gradient (where DeepSpeed's ZeRO-1/2 make
    their IPG bucket; at the last layer's backward where none came first); ``state``: ``"backward"`` (set while
    backward runs: a recomputed forward marks nothing) and ``"forwards"`` (the forwards to mark: one more raises
    ``SecondMicroStep``)."""

    def first_post_grad(*_: Any) -> None:
        if state.pop("post_grad", False):
            timeline.mark("post_g")

    def on_layer_grad(mark: str) -> None:
        first_post_grad()
        timeline.mark(mark)

    def on_loss_grad(grad: torch.Tensor) -> None:
        state["backward"] = True
        state["post_grad"] = True
        timeline.mark("loss_grad")

        def done() -> None:
            state["backward"] = False
            timeline.mark("bwd_end")

        torch.autograd.Variable._execution_engine.queue_callback(done)

    def model_pre(_module: torch.nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        timeline.mark("fwd")
        state["forwards"] -= 1
        if state["forwards"] < 0:
            raise SecondMicroStep

    def model_post(
        _module: torch.nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: CausalLMOutputWithPast
    ) -> None:
        timeline.mark("loss")
        assert output.loss is not None  # the step passes labels
        output.loss.register_hook(on_loss_grad)

    model.register_forward_pre_hook(model_pre, with_kwargs=True)
    model.register_forward_hook(model_post, with_kwargs=True)
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(first_post_grad)
    for i, layer in enumerate(decoder_layers(model)):

        def pre(_module: torch.nn.Module, args: tuple[Any, ...], i: int = i) -> None:
            if state["backward"]:
                return
            timeline.mark(f"f{i}")
            if i == 0:
                args[0].register_hook(lambda g: timeline.mark("b0e"))

        def post(_module: torch.nn.Module, _args: tuple[Any, ...], output: Any, i: int = i) -> None:
            if state["backward"]:
                return
            timeline.mark(f"f{i}e")
            hidden = output[0] if isinstance(output, tuple) else output  # Falcon's and BLOOM's layers return tuples
            hidden.register_hook(lambda g: on_layer_grad(f"b{i}"))

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)


def segments(layers: int) -> tuple[tuple[str, str, str], ...]:
    """(name, start mark, end mark) within one micro-step of a ``layers``-deep copy; "next" is the next
    micro-step's "fwd" or the end. Layers 0, 1 and the last are named f0/f1/f2 (b0/b1/b2) at every depth."""
    last = layers - 1
    return (
        ("pre_f", "fwd", "f0"),
        ("f0", "f0", "f1"),
        ("f1", "f1", "f2"),
        ("f2", f"f{last}", f"f{last}e"),
        ("post_f", f"f{last}e", "loss_grad"),
        ("post_b", "loss_grad", "post_g"),
        ("post_g", "post_g", f"b{last}"),
        ("b2", f"b{last}", f"b{last - 1}"),
        ("b1", "b1", "b0"),
        ("b0", "b0", "b0e"),
        ("pre_b", "b0e", "bwd_end"),
        ("gap", "bwd_end", "next"),
    )


EDGES = ("pre_f", "post_f", "post_b", "post_g", "pre_b", "gap")
"""The segments outside the decoder layers, which a layer can leave bytes to (``patterns.Patterns.per_layer``)."""


class Segment(Enum):
    """A segment of ``segments`` by its name there: the embedding's (``PRE_*``), the first, a middle and the last
    decoder layer's (``F0``-``F2`` forward, ``B0``-``B2`` backward), the head and loss's (``POST_*``), and the gap
    to the next micro-step; the head's backward in two, before and from its first parameter gradient
    (``POST_G``)."""

    PRE_F = "pre_f"
    F0 = "f0"
    F1 = "f1"
    F2 = "f2"
    POST_F = "post_f"
    POST_B = "post_b"
    POST_G = "post_g"
    B2 = "b2"
    B1 = "b1"
    B0 = "b0"
    PRE_B = "pre_b"
    GAP = "gap"

    @property
    def edge(self) -> bool:
        """Outside the decoder layers (``EDGES``)."""
        return self.value in EDGES


class SegmentKey(NamedTuple):
    """A segment of one traced micro-step; ``patterns.Patterns`` keys it by its ``cache_name``,
    ``"<segment>@<micro>"``."""

    segment: Segment
    micro: int
    """1: the micro-step that allocates the gradients; 2: one that accumulates into them (``MICRO_STEPS``)."""

    @property
    def cache_name(self) -> str:
        return f"{self.segment.value}@{self.micro}"

    @classmethod
    def parse(cls, name: str) -> SegmentKey:
        segment, micro = name.split("@")
        return cls(Segment(segment), int(micro))


def split_segments(raw: RawTrace, *, layers: int) -> dict[str, list[int]]:
    """``{"<segment>@<micro>": [bytes relative to the segment start, ...]}`` including start and end points."""
    names = [name for name, _ in raw.marks if name != "loss"]
    expected = block_marks(layers)
    steps = 1 if raw.first_only else MICRO_STEPS
    if names != expected * steps + (["fwd"] if raw.first_only else []):
        raise TraceError(f"unexpected block order in the trace: {names[:20]}")
    out: dict[str, list[int]] = {}
    marks = [(n, i) for n, i in raw.marks if n != "loss"]
    for micro in range(steps):
        at = dict(marks[micro * len(expected) : (micro + 1) * len(expected)])
        after = (micro + 1) * len(expected)
        nxt = marks[after][1] if after < len(marks) else len(raw.points) - 1
        at["next"] = nxt
        for name, start, end in segments(layers):
            lo, hi = at[start], at[end]
            base = raw.points[lo]
            out[SegmentKey(Segment(name), micro + 1).cache_name] = [p - base for p in raw.points[lo : hi + 1]]
    return out
