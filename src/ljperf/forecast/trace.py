"""Trace the real HF model code on fake tensors and record its live-bytes timeline, segmented by block.

Run (normally through ``forecast``): ``traced_patterns(spec, precision="fp32", attn="sdpa", mode="full")``.

A 3-layer copy of the model (real hidden size, vocabulary and code) runs two micro-steps of
``models.step.accumulate`` under ``FakeTensorMode``: nothing is allocated. A recipe of one micro-step reads only the
first one's segments: its family is traced up to the second one's start (``first_only``), half the ops.
``LiveBytesTimeline`` counts tensor storages exactly as ``dist.memory.LiveTensorBytes`` does on a real CPU step, and
module/tensor hooks mark block boundaries: forward and backward of the embedding part ("pre"), of each decoder layer
and of the norm/LM-head/loss part ("post"). The layer 0 / layer 1 / layer 2 segments stand for the first, middle and
last layer of the full-depth model, which ``timeline`` composes. A 4-layer copy is traced too (at one shape, and at
the others only where it differs from the 3-layer one): where the edge segments (embedding, head, loss, the gap
between micro-steps) differ between the two, the difference is what each layer leaves to them, such as the bf16
weight copies autocast keeps for a recomputed layer until the forward's autocast region ends, and ``timeline``
counts it once per layer of the full model.

Every segment is traced at several (micro batch b, sequence s) shapes and each of its points is fitted exactly
as bytes = c · (1, b, s, b·s, s², b·s²) (micro batch 1 separately, as c · (1, s, s²)): tensor sizes are such
polynomials (s² from eager attention). The
integer coefficients are cached per architecture family, precision, attention and recompute mode under
``$LJPERF_CACHE_DIR`` (default ``~/.cache/ljperf``)/forecast, so later forecasts need no tracing.

Recompute modes (full, selective) are applied with ``ljperf.checkpoint.apply.apply_plan``, the code the
engines run, so the traced layers save exactly what training saves.

Some things run otherwise on CUDA, and a trace notes whether it met one (``cuda_differs``); for a CUDA
forecast of such a model a second family is traced as CUDA runs them (``as_cuda``). SDPA runs its math path on
CPU, which keeps the b·h·s² probabilities (and a dropout mask) for backward, where the call has attention
dropout (GPT-2) or a value head narrower than the query's (DeepSeek-V3's MLA); CUDA's memory-efficient kernel
fuses both and keeps its output and log-sum-exp, as CPU's flash kernel does otherwise. Conversely CUDA runs the
math path where neither of its fused kernels takes the call (``cuda_runs_math``: fp32 with grouped K/V heads),
which CPU's flash kernel takes. And CUDA's autocast runs some ops in fp32 that CPU's runs in the input's
precision (``CUDA_FP32``): GPT-2's tanh GELU cubes its bf16 input in fp32, so it keeps an fp32 copy of it and
the rest of the GELU runs in fp32.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.graph import _engine_run_backward
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ljperf.checkpoint.policies import every_layer
from ljperf.core.cache import cache_root, cached
from ljperf.core.errors import one_line
from ljperf.core.options import LOSS_CHUNKS
from ljperf.distributed.mesh import fake_tp_mesh
from ljperf.forecast.patches import real_code_paths, swapped
from ljperf.models.build import build_picked, replace_parameters
from ljperf.models.layout import decoder_layers
from ljperf.models.loss import use_chunked_loss
from ljperf.models.spec import ModelSpec, build_meta, with_layers
from ljperf.models.step import accumulate
from ljperf.models.tensor_parallel import parallelize

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from transformers.modeling_outputs import CausalLMOutputWithPast

TRACE_VERSION = 7
"""Bump when what a trace keeps changes (7: CUDA traces run autocast's fp32 ops in fp32, fp32 GQA on math)."""
TRACE_LAYERS = 3
"""Depth of the traced copy whose segments the composition uses."""
SLOPE_LAYERS = TRACE_LAYERS + 1
"""Depth of the second copy: the edge segments' per-layer share is their difference from the first."""
FAMILIES = {
    "b1": ((1, 32), (1, 64), (1, 96), (1, 128)),
    "bn": ((2, 32), (3, 32), (4, 32), (2, 64), (3, 64), (2, 96), (3, 96)),
}
"""Shapes traced per family. Micro batch 1 is its own family: some copies (``.contiguous()``) vanish at b=1.
Each family has one shape more than coefficients, so every fit is also checked."""
MICRO_STEPS = 2
"""Micro-step 1 allocates the gradients; micro-step 2 (and every later one) accumulates into them."""


class _SecondMicroStep(Exception):
    """Raised where a trace of the first micro-step only reaches the second one's start."""


def family(micro_batch: int) -> str:
    return "b1" if micro_batch == 1 else "bn"


def monomials(b: int, s: int) -> tuple[int, ...]:
    """The terms tensor sizes are made of; at b=1 the b-terms coincide, so that family keeps (1, s, s²)."""
    return (1, s, s * s) if b == 1 else (1, b, s, b * s, s * s, b * s * s)


class TraceError(RuntimeError):
    """The model could not be traced consistently; the forecast falls back to the analytic formula."""


_DEVICE = torch.ops.prim.device.default


def fake_device(func: OpOverload, args: Sequence[Any]) -> torch.device | None:
    """A fake tensor's device where ``func`` is ``prim.device``, answered as FakeTensor answers it (None for any
    other op or tensor), so that a dispatch mode spares it the trip through FakeTensorMode's dispatch: autograd
    asks every fake tensor's device, two of three ops a fake step dispatches (a trace takes ~13% less time)."""
    if func is _DEVICE and type(args[0]) is FakeTensor and not args[0].fake_mode.in_kernel_invocation:
        return args[0].fake_device
    return None


class LiveBytesTimeline(TorchDispatchMode):
    """Live tensor-storage bytes after every allocating aten op, with named marks (works on fake tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.points: list[int] = []
        self.marks: list[tuple[str, int]] = []
        self._sizes: dict[int, int] = {}
        self._alive: dict[int, weakref.ref] = {}

    def track(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, DTensor):  # this rank's shard, as ``dist.memory.LiveTensorBytes`` counts it
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            return False
        nbytes = storage.nbytes()
        if nbytes == 0:
            return False
        self._sizes[key] = nbytes
        self.current += nbytes
        self._alive[key] = weakref.ref(storage, functools.partial(self._release, key))
        return True

    def _release(self, key: int, _dead: weakref.ref | None = None) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._alive.pop(key, None)

    def mark(self, name: str) -> None:
        self.points.append(self.current)
        self.marks.append((name, len(self.points) - 1))

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ):
        if (device := fake_device(func, args)) is not None:
            return device
        out = func(*args, **(kwargs or {}))
        if func is _DEVICE:  # another tensor's: no allocation
            return out
        tensors = (
            (out,) if isinstance(out, torch.Tensor) else [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        )
        if any([self.track(t) for t in tensors]):
            self.points.append(self.current)
        return out


def fake_model(
    spec: ModelSpec,
    *,
    attn: str,
    fake_mode: FakeTensorMode,
    dtype: torch.dtype | None = None,
    pick: Sequence[int] | None = None,
    tp: int = 1,
) -> torch.nn.Module:
    """``spec``'s model with fake CPU parameters (in ``dtype`` if given) and buffers (tied weights stay tied);
    with ``pick``, a copy of those of its layers (``models.build.build_picked``); with ``tp``, rank 0's shards of
    it split over that many ranks (``models.tensor_parallel``) on a fake process group."""
    if pick is None:
        model = build_meta(spec, attn_implementation=attn)
    else:
        model = build_picked(spec, pick, attn_implementation=attn)
    if tp > 1:  # on the meta device: real (or fake) values would be scattered from rank 0 over the group
        parallelize(model, fake_tp_mesh(tp))
    with fake_mode:
        replace_parameters(model, lambda _m, _k, param: torch.nn.Parameter(_empty_like(param, dtype=dtype)))
    for module in model.modules():
        if getattr(module, "layerdrop", None) == 0:
            module.layerdrop = _NeverDrops()
    return fake_buffers(model, fake_mode)


def _empty_like(param: torch.Tensor, *, dtype: torch.dtype | None) -> torch.Tensor:
    """An uninitialized tensor like the meta ``param`` (in ``dtype`` if given); a DTensor's: its local shard."""
    dtype = dtype or param.dtype
    if not isinstance(param, DTensor):
        return torch.empty(param.shape, dtype=dtype)
    local = torch.empty(param._local_tensor.shape, dtype=dtype)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class _NeverDrops:
    """A LayerDrop probability of 0 that compares without a value: transformers 5.17's OPT tests
    ``torch.rand([]) < layerdrop`` in training even at 0, a branch on a value that fake tensors do not have
    (the tensor's ``<`` gives way to this ``>``)."""

    def __gt__(self, _other: object) -> bool:
        return False

    def __lt__(self, _other: object) -> bool:
        return False


def fake_buffers(model: torch.nn.Module, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """``model`` with its (real CPU) buffers made fake, in place."""
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = fake_mode.from_tensor(buf)
    return model


@dataclass(frozen=True)
class RawTrace:
    """The timeline of one traced shape: points and (mark name, point index)."""

    points: list[int]
    marks: list[tuple[str, int]]
    cuda_differs: bool = False
    """An SDPA call took the math path or would take it on CUDA (``cuda_runs_math``), or an op of ``CUDA_FP32``
    ran on a bf16 input under autocast: CUDA runs each otherwise (see the module docstring)."""
    first_only: bool = False
    """Traced up to the second micro-step's start (its "fwd" mark): the first micro-step's segments only."""


def block_marks(layers: int) -> list[str]:
    """The block marks of one micro-step of a ``layers``-deep copy ("loss", set when the model returns, is
    ignored)."""
    forward = [mark for i in range(layers) for mark in (f"f{i}", f"f{i}e")]
    return ["fwd", *forward, "loss_grad", *(f"b{i}" for i in reversed(range(layers))), "b0e", "bwd_end"]


def trace_shape(
    spec: ModelSpec,
    *,
    micro_batch: int,
    seq_len: int,
    precision: str,
    attn: str,
    mode: str,
    layers: int,
    as_cuda: bool = False,
    pick: tuple[int, ...] | None = None,
    tp: int = 1,
    loss: str = "plain",
    first_only: bool = False,
) -> RawTrace:
    """Run ``MICRO_STEPS`` micro-steps of the real training code on fake tensors and record the timeline
    (``first_only``: up to the second one's start, where the first one's gap to it ends);
    ``as_cuda``: SDPA calls as CUDA runs them (its fused kernel where CPU runs math, math where it does), and the
    ops of ``CUDA_FP32`` in fp32 as CUDA's autocast does; ``pick``: the full model's (first, middle, last) layers
    the copy is made of, the middle one repeated (``layer_picks``); ``tp``: rank 0 of that many tensor-parallel
    ranks, the copy split as the engine splits it (``models.tensor_parallel``) on a fake process group; ``loss``:
    plain or chunked (``models.loss``)."""
    fake_mode = FakeTensorMode()
    dtype = torch.bfloat16 if precision == "bf16-params" else None
    picked = None if pick is None else (pick[0], *[pick[1]] * (layers - 2), pick[-1])
    shallow = with_layers(spec, layers, pick=picked)
    # picked layers are copied from the full model; otherwise the shallow config builds its own
    source = shallow if picked is None else spec
    model = fake_model(source, attn=attn, fake_mode=fake_mode, dtype=dtype, pick=picked, tp=tp)
    if mode != "none":
        every_layer(mode).apply(model)
    if loss == "chunked":
        use_chunked_loss(model)
    timeline = LiveBytesTimeline()
    state = {"backward": False, "cuda_differs": False, "forwards": 1 if first_only else MICRO_STEPS}
    _install_marks(model, timeline, state)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def traced_sdpa(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, dropout_p: float = 0.0, **kwargs: Any
    ) -> torch.Tensor:
        cuda_math = cuda_runs_math(query, key, value, attn_mask=kwargs.get("attn_mask"))
        if as_cuda and cuda_math:
            with sdpa_kernel(SDPBackend.MATH):
                return sdpa(query, key, value, *args, dropout_p=dropout_p, **kwargs)
        if as_cuda and (dropout_p > 0 or value.shape[-1] != query.shape[-1]):
            return _FusedAttention.apply(query, key, value)
        out = sdpa(query, key, value, *args, dropout_p=dropout_p, **kwargs)
        cpu_math = out.grad_fn is not None and "ScaledDotProduct" not in type(out.grad_fn).__name__
        state["cuda_differs"] |= cpu_math or cuda_math
        return out

    with contextlib.ExitStack() as stack:
        stack.enter_context(swapped(torch.nn.functional, "scaled_dot_product_attention", traced_sdpa))
        stack.enter_context(real_code_paths())
        stack.enter_context(CudaAutocastFp32(state, cast=as_cuda))
        stack.enter_context(fake_mode)
        # A fake kernel that refuses its inputs logs its traceback before raising: the error says it once.
        stack.enter_context(_quiet("torch._subclasses.fake_tensor"))
        if tp > 1:
            stack.enter_context(loss_parallel())
        batches = [torch.zeros(micro_batch, seq_len, dtype=torch.long) for _ in range(MICRO_STEPS)]
        for tensor in [*model.parameters(), *model.buffers(), *batches]:
            timeline.track(tensor)
        stack.enter_context(timeline)
        try:
            accumulate(model, batches, autocast=_autocast(precision))
        except _SecondMicroStep:
            pass
        except (RuntimeError, NotImplementedError) as exc:  # e.g. a kernel whose fake version refuses fp32
            raise TraceError(f"its training step does not run on fake tensors: {one_line(exc)}") from exc
    return RawTrace(
        points=timeline.points, marks=timeline.marks, cuda_differs=state["cuda_differs"], first_only=first_only
    )


def _autocast(precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """The autocast a run of the traced ``precision`` trains under: bf16 on the CPU unless fp32."""
    if precision == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type="cpu", dtype=torch.bfloat16)


CUDA_FP32 = frozenset({
    torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.Tensor.__rpow__, torch.exp, torch.Tensor.exp,
    torch.log, torch.Tensor.log, torch.rsqrt, torch.Tensor.rsqrt, torch.reciprocal, torch.Tensor.reciprocal,
    torch.nn.functional.layer_norm, torch.nn.functional.group_norm, torch.nn.functional.softplus,
})  # fmt: skip
CUDA_FP32_UNLESS_DTYPE = frozenset({
    torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax, torch.log_softmax, torch.Tensor.log_softmax,
    torch.nn.functional.log_softmax, torch.sum, torch.Tensor.sum, torch.cumsum, torch.Tensor.cumsum,
})  # fmt: skip
"""The ops of CUDA autocast's fp32 list (``autocast_mode.cpp``) that model code calls and CPU's autocast runs in
the input's precision; the second set only when no ``dtype`` is given."""


class CudaAutocastFp32(TorchFunctionMode):
    """Under autocast, notes an op of ``CUDA_FP32`` called on a bf16 (or fp16) tensor in ``state["cuda_differs"]``
    and, with ``cast``, casts its floating inputs to fp32 first, as CUDA's autocast does (the cast copies are
    what the op saves for backward)."""

    def __init__(self, state: dict[str, bool], *, cast: bool):
        super().__init__()
        self.state, self.cast = state, cast

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.cast and func is torch.Tensor.backward:
            return self._backward(*args, **kwargs)
        listed = func in CUDA_FP32 or (func in CUDA_FP32_UNLESS_DTYPE and kwargs.get("dtype") is None)
        if listed and torch.is_autocast_enabled("cpu"):
            if any(_low_precision(t) for t in tree_leaves((args, kwargs))):
                self.state["cuda_differs"] = True
                if self.cast:
                    args, kwargs = tree_map(lambda t: t.float() if _low_precision(t) else t, (args, kwargs))
        return func(*args, **kwargs)

    def _backward(
        self,
        tensor: torch.Tensor,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``tensor.backward()`` with this mode on: a mode is off while its own handler runs, and a checkpointed
        layer's forward is recomputed inside backward, under autocast, where CUDA casts as in the forward."""
        if gradient is None:  # as ``torch.autograd.backward`` makes it
            gradient = torch.ones_like(tensor, memory_format=torch.preserve_format)
        keep = create_graph if retain_graph is None else retain_graph
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs or ())
        with self:
            _engine_run_backward(
                (tensor,), (gradient,), keep, create_graph, inputs, allow_unreachable=True, accumulate_grad=True
            )


def _low_precision(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16)


def cuda_runs_math(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, attn_mask: torch.Tensor | None
) -> bool:
    """Whether CUDA's SDPA runs this call on its math path (which keeps the b·h·s² probabilities), as torch
    (2.11–2.13, sm80+) picks its kernel: flash takes fp16/bf16 only, equal head sizes up to 256 and no mask;
    memory-efficient takes no grouped K/V heads (``enable_gqa``) and head sizes aligned to 4 (fp32) or 8
    elements. So fp32 training of a GQA model (Llama 3, Qwen, Mistral) runs math, where CPU's flash kernel
    (which takes GQA in fp32) does not."""
    # SDPA is on both autocasts' lower-precision lists: under the trace's CPU autocast, CUDA's casts as CPU's does
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    heads = query.shape[-1], value.shape[-1]
    flash = dtype in (torch.float16, torch.bfloat16) and attn_mask is None and heads[0] == heads[1] <= 256
    align = 4 if dtype == torch.float32 else 8
    efficient = query.shape[-3] == key.shape[-3] and all(h % align == 0 for h in heads)
    return not (flash or efficient)


class _FusedAttention(torch.autograd.Function):
    """What CUDA's memory-efficient SDPA kernel keeps for backward (its inputs, output and fp32 log-sum-exp) and
    makes there (the inputs' gradients); on fake tensors only the sizes count."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        b, h, s, _ = query.shape
        # laid out (batch, seq, heads, dim) as the kernels write it: the layers' transpose back makes no copy
        out = query.new_empty((b, s, h, value.shape[-1])).transpose(1, 2)
        lse = query.new_empty((b, h, s), dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors[:3])


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _install_marks(model: torch.nn.Module, timeline: LiveBytesTimeline, state: dict) -> None:
    def on_loss_grad(grad: torch.Tensor) -> None:
        state["backward"] = True
        timeline.mark("loss_grad")

        def done() -> None:
            state["backward"] = False
            timeline.mark("bwd_end")

        torch.autograd.Variable._execution_engine.queue_callback(done)

    def model_pre(_module: torch.nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        timeline.mark("fwd")
        state["forwards"] -= 1
        if state["forwards"] < 0:
            raise _SecondMicroStep

    def model_post(
        _module: torch.nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: CausalLMOutputWithPast
    ) -> None:
        timeline.mark("loss")
        output.loss.register_hook(on_loss_grad)

    model.register_forward_pre_hook(model_pre, with_kwargs=True)
    model.register_forward_hook(model_post, with_kwargs=True)
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
            hidden.register_hook(lambda g: timeline.mark(f"b{i}"))

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)


# --- segments ---------------------------------------------------------------------------------------------
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
        ("post_b", "loss_grad", f"b{last}"),
        ("b2", f"b{last}", f"b{last - 1}"),
        ("b1", "b1", "b0"),
        ("b0", "b0", "b0e"),
        ("pre_b", "b0e", "bwd_end"),
        ("gap", "bwd_end", "next"),
    )


EDGES = ("pre_f", "post_f", "post_b", "pre_b", "gap")
"""The segments outside the decoder layers, which a layer can leave bytes to (``Patterns.per_layer``)."""


class Segment(Enum):
    """A segment of ``segments`` by its name there: the embedding's (``PRE_*``), the first, a middle and the last
    decoder layer's (``F0``-``F2`` forward, ``B0``-``B2`` backward), the head and loss's (``POST_*``), and the gap
    to the next micro-step."""

    PRE_F = "pre_f"
    F0 = "f0"
    F1 = "f1"
    F2 = "f2"
    POST_F = "post_f"
    POST_B = "post_b"
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
    """A segment of one traced micro-step; ``Patterns`` keys it by its ``cache_name``, ``"<segment>@<micro>"``."""

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


@dataclass(frozen=True)
class Patterns:
    """Fitted segment patterns of one shape family: rows of integer coefficients over ``monomials(b, s)``."""

    segments: dict[str, list[list[int]]]
    """``"<segment>@<micro>"`` → one coefficient row per timeline point (first = start, last = end), as the
    ``TRACE_LAYERS``-deep copy runs them."""
    per_layer: dict[str, list[list[int]]]
    """Edge segment → what each layer adds to its points (rows as in ``segments``); absent where nothing."""
    cuda_differs: bool = False
    """The traces met something CUDA runs otherwise (``RawTrace.cuda_differs``)."""
    divisor: int = 1
    """The coefficients are of ``divisor`` × bytes (``--loss chunked``: × ``LOSS_CHUNKS``, a chunk's tokens are
    a fraction of b·s; ``--tp``: a rank's share of a sequence-parallel tensor has
    bytes per token that are fractions of tp, such as 4 / 8 for one fp32 value a token at ``--tp 8``)."""

    def segment_keys(self) -> list[SegmentKey]:
        return [SegmentKey.parse(name) for name in self.segments]

    def shares(self, key: SegmentKey) -> bool:
        """Whether each layer adds to the points of segment ``key`` (an edge's ``per_layer``)."""
        return key.cache_name in self.per_layer

    def points(self, key: SegmentKey, b: int, s: int, *, per_layer: bool = False) -> list[int]:
        """The points of segment ``key`` at micro batch ``b`` and sequence ``s`` (of its per-layer share)."""
        rows = self.per_layer[key.cache_name] if per_layer else self.segments[key.cache_name]
        m = monomials(b, s)
        return [sum(c * x for c, x in zip(row, m, strict=True)) // self.divisor for row in rows]

    def evaluate(self, b: int, s: int) -> dict[SegmentKey, tuple[int, int]]:
        """``segment → (peak above its start, end minus start)`` at micro batch ``b`` and sequence ``s``."""
        return {key: peak_and_net(self.points(key, b, s)) for key in self.segment_keys()}


def peak_and_net(values: list[int]) -> tuple[int, int]:
    """(peak above the start, end minus start) of a segment's points."""
    return max(values), values[-1]


def fit_patterns(
    traces: dict[tuple[int, int], RawTrace], *, layers: int, divisor: int = 1
) -> dict[str, list[list[int]]]:
    """Fit every point of every segment, times ``divisor``, exactly over the traced shapes; raises TraceError when
    not exact."""
    shapes = list(traces)
    split = {shape: split_segments(raw, layers=layers) for shape, raw in traces.items()}
    x = torch.tensor([monomials(b, s) for b, s in shapes], dtype=torch.float64)
    fitted: dict[str, list[list[int]]] = {}
    for name in split[shapes[0]]:
        lengths = {len(split[shape][name]) for shape in shapes}
        if len(lengths) != 1:
            raise TraceError(f"segment {name} has a shape-dependent op sequence ({sorted(lengths)} points)")
        y = torch.tensor([split[shape][name] for shape in shapes], dtype=torch.float64)
        fitted[name] = _exact_fit(x, y * divisor, name)
    return fitted


def with_per_layer(
    reference: dict[str, list[list[int]]],
    deeper: dict[str, list[list[int]]],
    *,
    cuda_differs: bool = False,
    divisor: int = 1,
) -> Patterns:
    """Patterns from the fits of the ``TRACE_LAYERS``- and ``SLOPE_LAYERS``-deep copies: the layers' segments
    must agree (the composition repeats them), and an edge segment's difference is its per-layer share."""
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
    return Patterns(segments=reference, per_layer=per_layer, cuda_differs=cuda_differs, divisor=divisor)


def _exact_fit(x: torch.Tensor, y: torch.Tensor, name: str) -> list[list[int]]:
    coef = torch.linalg.lstsq(x, y).solution.round()
    if (x @ coef - y).abs().max() > 0.5:
        raise TraceError(f"segment {name}: bytes are not a polynomial in batch and sequence length")
    return coef.T.to(torch.int64).tolist()


# --- cache ----------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    return cache_root() / "forecast"


def architecture_key(spec: ModelSpec, *extra: str) -> str:
    """The config without its depth, plus ``extra`` and the package versions: what traced numbers depend on."""
    config = {k: v for k, v in spec.facts.config_dict.items() if k not in ("num_hidden_layers", "layer_types")}
    blob = json.dumps([config, *extra, _versions(), TRACE_VERSION], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def family_key(spec: ModelSpec, *, precision: str, attn: str, mode: str) -> str:
    """Architecture family: the config without its depth, plus what changes the traced code path."""
    return architecture_key(spec, precision, attn, mode)


@functools.cache
def _versions() -> dict[str, str]:
    # Reading package metadata costs ~7 ms a call: most of a warm forecast, which solvers call hundreds of times.
    return {p: metadata.version(p) for p in ("torch", "transformers")}


_PATTERNS: dict[Path, Patterns] = {}
"""Patterns read or traced in this process: a solver calls ``forecast`` hundreds of times."""
_FAILED: dict[Path, TraceError] = {}
"""Traces that failed in this process: each of those calls falls back to the analytic formula at once."""
_ONE_STEP: dict[Path, Path] = {}
"""A family's file of both micro-steps → the file a recipe of one micro-step reads: that one where it was at hand,
else the first micro-step's alone."""


def layer_picks(kinds: Sequence[int]) -> dict[int, tuple[int, int, int] | None]:
    """``{kind: pick}`` for each kind of middle decoder layer (``kinds``: one per layer of the full model): the
    full model's first layer, the first middle one of that kind and the last, which a traced copy is made of;
    ``{kind: None}`` where every layer is alike (the copy's own layers, as its config builds them)."""
    n = len(kinds)
    if len(set(kinds)) == 1:
        return {kinds[0]: None}
    picks: dict[int, tuple[int, int, int] | None] = {}
    for i in range(1, n - 1) if n > 2 else (n - 1,):
        picks.setdefault(kinds[i], (0, i, n - 1))
    return picks


def reference_kind(kinds: Sequence[int]) -> int:
    """The most frequent kind of middle layer: its copy's first and last layers, edges and per-layer costs stand
    for all kinds (every copy has the same first and last layers)."""
    middle = list(kinds[1:-1]) or list(kinds[-1:])
    return max(dict.fromkeys(middle), key=middle.count)


def traced_patterns(
    spec: ModelSpec,
    *,
    precision: str,
    attn: str,
    mode: str,
    micro_batch: int,
    device: str = "cpu",
    pick: tuple[int, ...] | None = None,
    tp: int = 1,
    loss: str = "plain",
    first_only: bool = False,
) -> Patterns:
    """The fitted patterns of one architecture and shape family on ``device``, from the cache or traced now (and
    cached): CPU's, and for CUDA those traced as CUDA runs them where CPU's differ (``cuda_differs``). ``pick``: a
    copy of those layers of the full model (``layer_picks``); ``tp``: one rank of that many tensor-parallel ones;
    ``loss``: plain or chunked (``--loss``); ``first_only``: the first micro-step's segments suffice (a recipe of
    one micro-step): both micro-steps' where they are cached, else the first one's alone."""
    kwargs = {"precision": precision, "attn": attn, "mode": mode, "micro_batch": micro_batch, "pick": pick}
    kwargs |= {"tp": tp, "loss": loss, "first_only": first_only}
    patterns = _traced_patterns(spec, **kwargs)
    if device == "cuda" and patterns.cuda_differs:
        return _traced_patterns(spec, **kwargs, as_cuda=True)
    return patterns


def _family_path(spec: ModelSpec, *, precision: str, attn: str, mode: str, fam: str, variant: str) -> Path:
    """The cache file of one traced family: ``variant`` is ``mode`` and what else changes the traced code path."""
    key = family_key(spec, precision=precision, attn=attn, mode=variant)
    return cache_dir() / f"{spec.architecture}-{mode}-{fam}-{key}.json"


def _traced_patterns(
    spec: ModelSpec,
    *,
    precision: str,
    attn: str,
    mode: str,
    micro_batch: int,
    as_cuda: bool = False,
    pick: tuple[int, ...] | None = None,
    tp: int = 1,
    loss: str = "plain",
    first_only: bool = False,
) -> Patterns:
    fam = family(micro_batch)
    variant = mode + ("-cuda" if as_cuda else "") + (f"-tp{tp}" if tp > 1 else "")
    variant += f"-loss-{loss}-{LOSS_CHUNKS}" if loss != "plain" else ""
    # a chunk's tensors hold 1/LOSS_CHUNKS of the tokens: bytes per token that are fractions, as under --tp
    divisor = tp * (LOSS_CHUNKS if loss != "plain" else 1)
    if pick is not None:  # its layers, of this depth
        variant += f"-layers-{'-'.join(map(str, pick))}-of-{spec.layers}"
    path = _family_path(spec, precision=precision, attn=attn, mode=mode, fam=fam, variant=variant)
    if first_only:
        if path not in _ONE_STEP:  # once per process: a solver forecasts hundreds of times
            both = path in _PATTERNS or path in _FAILED or path.exists()
            first = _family_path(spec, precision=precision, attn=attn, mode=mode, fam=fam, variant=f"{variant}-first")
            _ONE_STEP[path] = path if both else first
        chosen = _ONE_STEP[path]
        first_only, path = chosen != path, chosen
    if path in _FAILED:
        raise _FAILED[path]
    if path not in _PATTERNS:
        options = {"precision": precision, "attn": attn, "mode": mode, "as_cuda": as_cuda, "pick": pick}
        options |= {"tp": tp, "loss": loss, "first_only": first_only}

        def trace(shape: tuple[int, int], layers: int) -> RawTrace:
            return trace_shape(spec, micro_batch=shape[0], seq_len=shape[1], layers=layers, **options)

        def make() -> Patterns:
            shapes = FAMILIES[fam]
            reference = {shape: trace(shape, TRACE_LAYERS) for shape in shapes}
            differs = any(raw.cuda_differs for raw in reference.values())
            patterns = fit_patterns(reference, layers=TRACE_LAYERS, divisor=divisor)
            # The deeper copy at one shape first: where its segments equal the reference's, no layer leaves anything
            # to the edges (the usual case), and the other shapes need not be traced again.
            probe = shapes[-1]
            deeper = {probe: trace(probe, SLOPE_LAYERS)}
            if split_segments(deeper[probe], layers=SLOPE_LAYERS) == split_segments(
                reference[probe], layers=TRACE_LAYERS
            ):
                return Patterns(segments=patterns, per_layer={}, cuda_differs=differs, divisor=divisor)
            deeper |= {shape: trace(shape, SLOPE_LAYERS) for shape in shapes[:-1]}
            slopes = fit_patterns(deeper, layers=SLOPE_LAYERS, divisor=divisor)
            return with_per_layer(patterns, slopes, cuda_differs=differs, divisor=divisor)

        try:
            _PATTERNS[path] = cached(
                path,
                load=lambda data: Patterns(
                    segments=data["segments"],
                    per_layer=data["per_layer"],
                    cuda_differs=data["cuda_differs"],
                    divisor=data.get("divisor", 1),
                ),
                make=make,
                dump=lambda p: {
                    "trace_version": TRACE_VERSION,
                    "segments": p.segments,
                    "per_layer": p.per_layer,
                    "cuda_differs": p.cuda_differs,
                    "divisor": p.divisor,
                },
            )
        except TraceError as exc:
            _FAILED[path] = exc
            raise
    return _PATTERNS[path]
