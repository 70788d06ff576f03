"""Trace the real HF model code on fake tensors, its training micro-steps as the engines run them, and serve the
fitted patterns of each architecture family from the cache or traced now.

Run (normally through ``forecast``): ``traced_patterns(*family_key(spec, precision="fp32", attn="sdpa",
mode="full", micro_batch=2, seq_len=64))``; one shape: ``trace_shape(spec, micro_batch=2, seq_len=64,
precision="fp32", attn="sdpa", mode="full", layers=3)``.

A 3-layer copy of the model (real hidden size, vocabulary and code) runs two micro-steps of
``models.step.accumulate`` under ``FakeTensorMode``: nothing is allocated. A recipe of one micro-step reads only the
first one's segments: its family is traced up to the second one's start (``first_only``), half the ops.
``live_bytes.LiveBytesTimeline`` counts the tensor storages, and the hooks of ``segments.install_marks`` mark the
blocks' boundaries (``segments``); each family's shapes are fitted (``patterns``) and cached under
``$LJPERF_CACHE_DIR`` (default ``~/.cache/ljperf``)/forecast, one entry per ``cache_key.FamilyKey``, so later
forecasts need no tracing. Recompute modes (full, selective) are applied with ``ljperf.checkpoint.policies``,
the code the engines run, so the traced layers save exactly what training saves.

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
import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import _engine_run_backward
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from ljperf.checkpoint.policies import every_layer
from ljperf.core.cache import cached
from ljperf.core.errors import one_line
from ljperf.distributed.mesh import fake_tp_mesh
from ljperf.forecast.cache_key import FamilyKey, cache_dir
from ljperf.forecast.live_bytes import LiveBytesTimeline
from ljperf.forecast.patches import real_code_paths, swapped
from ljperf.forecast.patterns import FAMILIES, Patterns, family, family_shapes, fit_patterns, with_per_layer
from ljperf.forecast.segments import MICRO_STEPS, RawTrace, SecondMicroStep, TraceError, install_marks, split_segments
from ljperf.models.build import build_picked, replace_parameters
from ljperf.models.loss import use_chunked_loss
from ljperf.models.spec import ModelSpec, build_meta, with_layers, with_window
from ljperf.models.step import accumulate
from ljperf.models.tensor_parallel import parallelize

TRACE_LAYERS = 3
"""Depth of the traced copy whose segments the composition uses."""
SLOPE_LAYERS = TRACE_LAYERS + 1
"""Depth of the second copy: the edge segments' per-layer share is their difference from the first."""


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
            # cast: torch types a module's attributes as its tensors and submodules; a LayerDrop probability is neither
            cast(Any, module).layerdrop = _NeverDrops()
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
    install_marks(model, timeline, state)
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
        except SecondMicroStep:
            pass
        except RuntimeError as exc:  # NotImplementedError too: e.g. a kernel whose fake version refuses fp32
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

    def __init__(self, state: dict[str, Any], *, cast: bool):
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
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # torch's Function.backward takes the outputs' gradients as *args: none is read (only the sizes count)
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors[:3])


@contextlib.contextmanager
def _quiet(logger: str) -> Generator[None, None, None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


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


_PATTERNS: dict[FamilyKey, Patterns] = {}
"""Patterns read or traced in this process: a solver calls ``forecast`` hundreds of times."""
_FAILED: dict[FamilyKey, TraceError] = {}
"""Traces that failed in this process: each of those calls falls back to the analytic formula at once."""
_ONE_STEP: dict[FamilyKey, FamilyKey] = {}
"""A family's key of both micro-steps → the key a recipe of one micro-step reads: that one where it was at hand,
else the first micro-step's alone."""


SHORTEST, LONGEST = (f(s for shapes in FAMILIES.values() for _, s in shapes) for f in (min, max))
"""The shortest and the longest sequence a family traces, shifted by none."""


def windowed(spec: ModelSpec, seq_len: int) -> tuple[ModelSpec, int]:
    """The model to trace for a recipe of ``seq_len`` tokens, and how many tokens longer its shapes are than the
    families': every traced shape on the same side of a sliding window as ``seq_len``. Under SDPA transformers makes
    the window's mask (b·s² booleans, and SDPA's path with a mask) only from the window's length up, so a family
    straddling it traces two op sequences, which no fit joins, and one wholly below it misses the mask. From the
    window up the shapes start at it; below it the traced copy's window is put past the longest shape, which
    changes nothing the model does under the window (eager attention builds its mask at every length)."""
    window = spec.fact("sliding_window")
    if not window:
        return spec, 0
    if seq_len >= window:
        return spec, max(0, window - SHORTEST)
    return (with_window(spec, LONGEST + 1) if window <= LONGEST else spec), 0


def traced_patterns(spec: ModelSpec, key: FamilyKey, *, device: str = "cpu", first_only: bool = False) -> Patterns:
    """The fitted patterns of the architecture and shape family ``key`` of ``spec`` (both as ``family_key`` gives
    them) on ``device``, from the cache or traced now (and cached): CPU's, and for CUDA those traced as CUDA runs
    them where CPU's differ (``cuda_differs``). ``first_only``: the first micro-step's segments suffice (a recipe of
    one micro-step): both micro-steps' where they are cached, else the first one's alone."""
    patterns = _traced_patterns(spec, key, first_only=first_only)
    if device == "cuda" and patterns.cuda_differs:
        return _traced_patterns(spec, replace(key, as_cuda=True), first_only=first_only)
    return patterns


def family_key(
    spec: ModelSpec,
    *,
    precision: str,
    attn: str,
    mode: str,
    micro_batch: int,
    seq_len: int,
    pick: tuple[int, ...] | None = None,
    tp: int = 1,
    loss: str = "plain",
) -> tuple[ModelSpec, FamilyKey]:
    """The spec traced and the key of its family ``traced_patterns`` reads: ``pick``, a copy of those layers of the
    full model (``layer_picks``); ``tp``, one rank of that many tensor-parallel ones; ``loss``, plain or chunked
    (``--loss``); ``seq_len``, the recipe's, which a sliding window's traced shapes follow (``windowed``)."""
    spec, offset = windowed(spec, seq_len)
    key = FamilyKey.of(
        spec, precision=precision, attn=attn, mode=mode, shapes=family(micro_batch), seq_offset=offset, pick=pick,
        tp=tp, loss=loss,
    )  # fmt: skip
    return spec, key


def is_cached(key: FamilyKey, *, first_only: bool) -> bool:
    """Whether ``key``'s family is in the cache, or, where one micro-step suffices, its first micro-step's."""
    if key in _PATTERNS or (cache_dir() / key.file_name()).exists():
        return True
    return first_only and (cache_dir() / replace(key, first_only=True).file_name()).exists()


def _traced_patterns(spec: ModelSpec, key: FamilyKey, *, first_only: bool) -> Patterns:
    if first_only:
        if key not in _ONE_STEP:  # once per process: a solver forecasts hundreds of times
            both = key in _PATTERNS or key in _FAILED or (cache_dir() / key.file_name()).exists()
            _ONE_STEP[key] = key if both else replace(key, first_only=True)
        key = _ONE_STEP[key]
    if key in _FAILED:
        raise _FAILED[key]
    if key not in _PATTERNS:
        try:
            _PATTERNS[key] = cached(
                cache_dir() / key.file_name(),
                load=lambda data: _read_entry(data, key),
                make=lambda: _trace_family(spec, key),
                dump=lambda patterns: {"key": key.to_json(), **patterns.entry()},
            )
        except TraceError as exc:
            _FAILED[key] = exc
            raise
    return _PATTERNS[key]


def _read_entry(data: dict, key: FamilyKey) -> Patterns:
    """The patterns of a cache entry, which must be ``key``'s (a file name holds a prefix of its digest)."""
    if FamilyKey.from_json(data["key"]) != key:
        raise ValueError(f"the entry is of another family: {data['key']}")
    return Patterns(
        segments=data["segments"],
        per_layer=data["per_layer"],
        cuda_differs=data["cuda_differs"],
        divisor=data["divisor"],
        seq_offset=data["seq_offset"],
    )


def _trace_family(spec: ModelSpec, key: FamilyKey) -> Patterns:
    """``key``'s family traced at each of its shapes and fitted: the ``TRACE_LAYERS``-deep copy, and the
    ``SLOPE_LAYERS``-deep one where a layer leaves bytes to the edges."""
    # a chunk's tensors hold 1/LOSS_CHUNKS of the tokens: bytes per token that are fractions, as under --tp
    divisor = key.tp * (key.loss_chunks or 1)

    def trace(shape: tuple[int, int], layers: int) -> RawTrace:
        return trace_shape(
            spec,
            micro_batch=shape[0],
            seq_len=shape[1],
            precision=key.precision,
            attn=key.attn,
            mode=key.mode,
            layers=layers,
            as_cuda=key.as_cuda,
            pick=key.pick,
            tp=key.tp,
            loss=key.loss,
            first_only=key.first_only,
        )

    offset = {"seq_offset": key.seq_offset}

    def fitted(layers: int, traces: dict[tuple[int, int], RawTrace]) -> dict[str, list[list[int]]]:
        """``traces`` at the family's first shapes fitted without squares of the sequence; where that does not fit,
        traced at its other shapes too and fitted whole (``patterns.LINEAR``)."""
        traces |= {shape: trace(shape, layers) for shape in linear if shape not in traces}
        try:
            return fit_patterns(traces, layers=layers, divisor=divisor, linear=True, **offset)
        except TraceError:
            traces |= {shape: trace(shape, layers) for shape in shapes if shape not in traces}
            return fit_patterns({shape: traces[shape] for shape in shapes}, layers=layers, divisor=divisor, **offset)

    shapes, linear = (family_shapes(key.shapes, seq_offset=key.seq_offset, linear=f) for f in (False, True))
    reference: dict[tuple[int, int], RawTrace] = {}
    patterns = fitted(TRACE_LAYERS, reference)
    differs = any(raw.cuda_differs for raw in reference.values())
    # The deeper copy at one shape first: where its segments equal the reference's, no layer leaves anything to the
    # edges (the usual case), and the other shapes need not be traced again.
    probe = linear[-1]
    deeper = {probe: trace(probe, SLOPE_LAYERS)}
    if split_segments(deeper[probe], layers=SLOPE_LAYERS) == split_segments(reference[probe], layers=TRACE_LAYERS):
        return Patterns(segments=patterns, per_layer={}, cuda_differs=differs, divisor=divisor, **offset)
    slopes = fitted(SLOPE_LAYERS, deeper)
    return with_per_layer(patterns, slopes, cuda_differs=differs, divisor=divisor, **offset)
