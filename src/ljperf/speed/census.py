"""Per-op FLOPs and bytes of a training step, from the real Hugging Face step on fake tensors: each op's class,
FLOPs (torch's ``flop_counter`` registry) and bytes read and written, for the forward, backward and optimizer step
of one decoder layer and of the rest (embedding, final norm, head, loss), at the recipe's shape.

Run: ``step_ops(spec, micro_batch=2, seq_len=1024, precision="bf16-mixed", attn="sdpa", loss="plain",
optimizer="fused")``. One- and two-layer copies of the model are traced (a second or two, cached on disk per
architecture, shape and code path): a layer's ops are the second copy's less the first's, and the rest is the
first's less one layer's. The optimizer step is kept per parameter element and per parameter tensor, which the
engine's sharding scales.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ljperf.checkpoint.policies import GROUPED_MM_OPS
from ljperf.core.cache import cached
from ljperf.core.errors import one_line
from ljperf.forecast.cache_key import architecture_key, cache_dir
from ljperf.forecast.patches import real_code_paths
from ljperf.forecast.segments import TraceError
from ljperf.forecast.trace import fake_model
from ljperf.models.loss import use_chunked_loss
from ljperf.models.spec import ModelSpec, with_layers
from ljperf.models.step import causal_lm_loss

if TYPE_CHECKING:
    from torch._ops import OpOverload

OP_CLASSES = ("matmul", "attention", "elementwise", "norm", "optimizer")
"""How ops are priced: each class has its own efficiency (``speed.rates.SpeedRates.efficiency``). ``norm`` holds
the norms, softmaxes and other reductions; ``optimizer`` every op of the optimizer step."""

SAVED = ("matmul", "attention")
"""The classes selective recompute keeps (``checkpoint.policies.SAVE_OPS``): it repeats the others."""

CENSUS_VERSION = 1
"""In the cache key: a change to what an op costs or how ops are classed counts again."""

_ATTENTION = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|flex_attention")
_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}) | GROUPED_MM_OPS
_REDUCTIONS = frozenset(
    {"sum", "mean", "var", "std", "amax", "amin", "max", "min", "logsumexp", "nll_loss_forward", "nll_loss_backward"}
)
_FREE = frozenset({"aten::detach", "aten::lift_fresh", "aten::_local_scalar_dense", "prim::device", "aten::alias"})
"""Ops that launch no kernel and move nothing."""


Entry = tuple[str, float, float, int]
"""(op class, FLOPs of one call, bytes one call reads and writes, calls)."""


@dataclass(frozen=True, kw_only=True)
class StepOps:
    """One micro-step's ops at one shape, split by block, and the optimizer step's per element and tensor."""

    layer_forward: tuple[Entry, ...]
    layer_backward: tuple[Entry, ...]
    rest_forward: tuple[Entry, ...]
    """Embedding, final norm, LM head and loss."""
    rest_backward: tuple[Entry, ...]
    optimizer_bytes_per_param_byte: float
    """Bytes the optimizer step reads and writes per byte of parameters (AdamW: parameter, gradient, moments)."""
    optimizer_ops_per_tensor: float
    """Its ops per parameter tensor (``single``: a loop of ops per tensor; ``foreach``/``fused``: a few in all)."""
    optimizer_ops_fixed: float
    """Its ops whatever the tensors (the fused kernel's launch, ``foreach``'s per-list ops)."""


def op_class(func: OpOverload) -> str:
    name = func._schema.name  # without the overload: ``aten::mean``, not ``aten::mean.dim``
    if name in _MATMULS:
        return "matmul"
    if _ATTENTION.search(name):
        return "attention"
    short = name.split("::")[-1].strip("_")
    if "norm" in short or "softmax" in short or short in _REDUCTIONS:
        return "norm"
    return "elementwise"


def _attention_flops(func: OpOverload, args: Sequence[Any]) -> float:
    """An attention kernel torch's counter does not know (CPU flash): q·kᵀ and p·v forward, twice that backward."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    backward = "backward" in func.name()
    q, k = (tensors[1], tensors[2]) if backward else (tensors[0], tensors[1])
    b, h, sq, d = q.shape
    return (8 if backward else 4) * b * h * sq * k.shape[2] * d


def _nbytes(t: torch.Tensor) -> int:
    try:  # an expanded or sliced view moves its storage at most
        return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
    except RuntimeError:  # NotImplementedError too
        return t.numel() * t.element_size()


def _moves(func: OpOverload, args: tuple, kwargs: dict, out: Any) -> tuple[bool, float]:
    """(launches a kernel, bytes read and written): its tensor inputs read, its outputs and the inputs it
    changes in place written; a view moves nothing."""
    from torch.utils._pytree import tree_leaves

    returns = func._schema.returns
    if func._schema.name in _FREE or (
        returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    ):
        return False, 0.0
    read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    mutated = [
        t
        for a, value in zip(func._schema.arguments, args, strict=False)
        if a.alias_info is not None and a.alias_info.is_write
        for t in tree_leaves(value)
        if isinstance(t, torch.Tensor)
    ]
    outputs = {id(t) for t in written}
    total = (
        sum(map(_nbytes, read)) + sum(map(_nbytes, written)) + sum(_nbytes(t) for t in mutated if id(t) not in outputs)
    )
    return True, float(total)


def _counter(phases: dict[str, Counter]) -> type:
    """A dispatch mode that adds each op to ``phases[mode.phase]`` as an ``Entry`` key (calls counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class Census(TorchDispatchMode):
        phase = "forward"

        def __torch_dispatch__(
            self, func: OpOverload, types: Sequence[type], args: tuple = (), kwargs: dict | None = None
        ) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            kernel, moved = _moves(func, args, kwargs, out)
            if not kernel:
                return out
            cls = "optimizer" if self.phase == "optimizer" else op_class(func)
            flops = 0.0
            if cls in SAVED:
                packet = func.overloadpacket
                if packet in flop_registry:
                    flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
                elif cls == "matmul":  # experts' grouped matmul: (tokens, in) by (experts, in, out)
                    flops = 2.0 * out.numel() * args[0].shape[-1]
                else:
                    flops = float(_attention_flops(func, args))
            phases[self.phase][(cls, flops, moved)] += 1
            return out

    return Census


def _traced(spec: ModelSpec, *, layers: int, micro_batch: int, seq_len: int, precision: str, attn: str, loss: str,
            optimizer: str) -> tuple[dict[str, Counter], int, int]:  # fmt: skip
    """Ops of a ``layers``-deep copy's forward, backward and AdamW step by phase, its parameter bytes and
    tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode()
    dtype = torch.bfloat16 if precision == "bf16-params" else None
    model = fake_model(with_layers(spec, layers), attn=attn, fake_mode=fake_mode, dtype=dtype)
    if loss == "chunked":
        use_chunked_loss(model)
    phases: dict[str, Counter] = {p: Counter() for p in ("forward", "backward", "optimizer")}
    census = _counter(phases)()
    params = list(model.parameters())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
    with real_code_paths(), fake_mode, census:
        tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        try:
            with autocast:
                value = causal_lm_loss(model, tokens)
            census.phase = "backward"
            value.backward()
            census.phase = "optimizer"
            foreach, fused = optimizer == "foreach", optimizer == "fused"
            torch.optim.AdamW(params, lr=1e-4, foreach=foreach, fused=fused or None).step()
        except RuntimeError as exc:  # e.g. experts that loop over nonzero(): no shape on fake tensors
            raise TraceError(f"its training step does not run on fake tensors: {one_line(exc)}") from exc
    return phases, sum(p.numel() * p.element_size() for p in params), len(params)


def _less(a: Counter, b: Counter) -> tuple[Entry, ...]:
    """The calls of ``a`` beyond ``b``'s, as entries."""
    return tuple(sorted((cls, flops, moved, n) for (cls, flops, moved), n in (a - b).items()))


def _trace_step_ops(spec: ModelSpec, **shape: Any) -> StepOps:
    one, _, one_tensors = _traced(spec, layers=1, **shape)
    two, two_bytes, two_tensors = _traced(spec, layers=2, **shape)
    layer = {phase: two[phase] - one[phase] for phase in ("forward", "backward")}
    opt_one, opt_two = (sum(n for n in c["optimizer"].values()) for c in (one, two))
    opt_bytes = sum(moved * n for (_, _, moved), n in two["optimizer"].items())
    per_tensor = (opt_two - opt_one) / max(two_tensors - one_tensors, 1)
    return StepOps(
        layer_forward=_less(layer["forward"], Counter()),
        layer_backward=_less(layer["backward"], Counter()),
        rest_forward=_less(one["forward"], layer["forward"]),
        rest_backward=_less(one["backward"], layer["backward"]),
        optimizer_bytes_per_param_byte=opt_bytes / two_bytes,
        optimizer_ops_per_tensor=per_tensor,
        optimizer_ops_fixed=max(0.0, opt_one - per_tensor * one_tensors),
    )


def _load(data: dict) -> StepOps:
    def entries(key: str) -> tuple[Entry, ...]:
        return tuple((str(c), float(f), float(m), int(n)) for c, f, m, n in data[key])

    return StepOps(
        layer_forward=entries("layer_forward"),
        layer_backward=entries("layer_backward"),
        rest_forward=entries("rest_forward"),
        rest_backward=entries("rest_backward"),
        optimizer_bytes_per_param_byte=float(data["optimizer_bytes_per_param_byte"]),
        optimizer_ops_per_tensor=float(data["optimizer_ops_per_tensor"]),
        optimizer_ops_fixed=float(data["optimizer_ops_fixed"]),
    )


_ENTRY_FIELDS = ("layer_forward", "layer_backward", "rest_forward", "rest_backward")
_NUMBER_FIELDS = ("optimizer_bytes_per_param_byte", "optimizer_ops_per_tensor", "optimizer_ops_fixed")


def step_ops(
    spec: ModelSpec, *, micro_batch: int, seq_len: int, precision: str, attn: str, loss: str, optimizer: str
) -> StepOps:
    """``StepOps`` of ``spec`` at ``micro_batch`` × ``seq_len`` on the traced code path (``Recipe.trace_precision``),
    cached on disk per architecture (not depth), shape, attention, loss and AdamW implementation."""
    shape = {"micro_batch": micro_batch, "seq_len": seq_len, "precision": precision, "attn": attn, "loss": loss}
    key = architecture_key(spec, f"speed census v{CENSUS_VERSION}", *map(str, shape.values()), optimizer)
    if key not in _KEPT:  # kept for the process too: a search prices thousands of recipes of a few shapes
        _KEPT[key] = cached(
            cache_dir() / f"{spec.architecture}-speed-{key}.json",
            load=_load,
            make=lambda: _trace_step_ops(spec, **shape, optimizer=optimizer),
            dump=lambda ops: {k: getattr(ops, k) for k in _ENTRY_FIELDS + _NUMBER_FIELDS},
        )
    return _KEPT[key]


_KEPT: dict[str, StepOps] = {}
