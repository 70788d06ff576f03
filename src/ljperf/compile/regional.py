"""Compile optimization: ``torch.compile`` per repeated block (regional), of the whole model, or off.

Run: ``ljperf benchmark --model torch/llama-tiny --compile`` (``--compile-mode regional|whole|off``);
``ljperf compile-report --model torch/llama-tiny --seq-lens 512,1000,2048`` explains breaks and recompiles.

A region is a module whose ``forward`` (not ``__call__``) is compiled, so the hooks of FSDP2, ZeRO-3 and
DDP stay outside every compiled graph. ``regional`` compiles each decoder block and the loss (torchtitan's
recipe: blocks of one class share one compiled graph); ``whole`` compiles the model's forward.
A region whose compile fails (forward or backward, or ``recompile_limit`` hit) runs eager from then on,
with a one-line reason in ``fallbacks``. Sequence lengths: the first length compiles static, the first
different one recompiles once with the sequence dimension dynamic (torch's automatic dynamic shapes),
later lengths reuse it. See docs/compile.md.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast, overload

import torch
import torch.utils.checkpoint

from ljperf.core.choices import CompileMode, TorchCompileMode, values_of
from ljperf.core.errors import UsageError, interruption, one_line, out_of_memory
from ljperf.models.layout import find_blocks


@dataclass
class CompileSession:
    """What compiling cost in this process since ``apply_compile``: the ``compile`` part of the result."""

    mode: CompileMode
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``torch.compile`` (backend, mode)."""
    regions: list[str] = field(default_factory=list)
    fallbacks: list[dict[str, str]] = field(default_factory=list)
    region_time_s: dict[str, float] = field(default_factory=dict)
    recompile_reasons: list[str] = field(default_factory=list)
    graph_breaks_at_start: int = field(default_factory=lambda: _graph_break_count())
    start_us: int = field(default_factory=lambda: time.time_ns() // 1000)
    verbose: bool = True
    external: str | None = None
    """A region compiled outside ljperf's wrappers (DeepSpeed's ``engine.compile()``): dynamo's metrics are
    booked to it when the results are read."""
    _seen_us: int = 0

    def collect(self, region: str) -> None:
        """Book to ``region`` the compilations dynamo recorded since the last ones booked."""
        from torch._dynamo.utils import get_compilation_metrics

        for m in get_compilation_metrics():
            begin = m.start_time_us or 0
            if begin < self.start_us or begin <= self._seen_us:
                continue
            self._seen_us = max(self._seen_us, begin)
            self.region_time_s[region] = self.region_time_s.get(region, 0.0) + (m.duration_us or 0) / 1e6
            lines = (m.recompile_reason or "").strip().splitlines()
            guard = lines[0] if lines else None
            if guard:
                self.recompile_reasons.append(f"{region}: {guard}")
            if m.fail_reason and "recompile limit" in m.fail_reason.lower():
                # dynamo runs these inputs eager from now on (no exception reaches the region)
                self.fallback(region, RuntimeError(f"recompile_limit hit; last guard failure: {guard}"))

    def fallback(self, region: str, exc: BaseException) -> None:
        reason = one_line(exc)
        self.fallbacks.append({"region": region, "reason": reason})
        if self.verbose:
            print(f"ljperf compile: {region} runs eager (compile failed: {reason})", file=sys.stderr)

    def results(self) -> dict[str, Any]:
        if self.external:
            self.collect(self.external)
        return {
            "mode": self.mode,
            **({"deepcompile": self.options["deepcompile"]} if "deepcompile" in self.options else {}),
            "regions": len(self.regions),
            "graph_breaks": _graph_break_count() - self.graph_breaks_at_start,
            "recompiles": len(self.recompile_reasons),
            "time_s": round(sum(self.region_time_s.values()), 3),
            "time_s_per_region": {k: round(v, 3) for k, v in self.region_time_s.items()},
            "recompile_reasons": self.recompile_reasons,
            "fallbacks": self.fallbacks,
        }


_session: CompileSession | None = None


def session() -> CompileSession | None:
    """This process's compile session (None when nothing was compiled)."""
    return _session


def _graph_break_count() -> int:
    return sum(_counters()["graph_break"].values())


def _counters() -> Any:
    """dynamo's counters, imported at the first compile: a launcher that starts the ranks never pays the 1.3 s
    (2 cores) that importing ``torch._dynamo`` takes."""
    from torch._dynamo.utils import counters

    return counters


# Not compile failures: OOM, and the exception a non-reentrant checkpoint's recompute stops early with (torch 2.11
# raises it through a checkpointed block's compiled forward; caught, the recompute ran twice and failed).
_PASS_THROUGH: tuple[type[BaseException], ...] = (
    torch.OutOfMemoryError,
    *filter(None, [getattr(torch.utils.checkpoint, "_StopRecomputationError", None)]),
)


class _Group:
    """Regions that run the same code (one block class): one failed compile sends them all to eager."""

    def __init__(self, label: str):
        self.label = label
        self.failed = False


class Region:
    """A callable standing in for a module's ``forward`` (or the loss): compiled, eager after a failure."""

    def __init__(self, name: str, resolve: Callable[[], Callable], group: _Group, sess: CompileSession):
        self.name = name
        self._resolve = resolve
        self._group = group
        self._session = sess
        self._eager: Callable | None = None
        self._compiled: Callable | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._eager is None or self._compiled is None:
            # Resolved at the first call: FSDP2's fully_shard swaps the module's class after compile is applied.
            self._eager = self._resolve()
            _ds_ids_dynamic()
            self._compiled = torch.compile(self._eager, **self._session.options)
        if self._group.failed:
            return self._eager(*args, **kwargs)
        frames = _counters()["frames"]["total"]
        try:
            out = self._compiled(*args, **kwargs)
        except _PASS_THROUGH:
            raise
        except Exception as exc:
            if (stop := interruption(exc)) is not None:  # Ctrl-C while compiling ends the run, as anywhere else
                raise stop from None
            if out_of_memory(exc):  # wrapped by inductor: not a compile failure either
                raise
            out = self._eager(*args, **kwargs)  # an error of the model itself raises here as well
            self._group.failed = True
            self._session.fallback(self._group.label, exc)
        if _counters()["frames"]["total"] != frames:
            self._session.collect(self.name)
        return out


def _ds_ids_dynamic() -> None:
    """Under DeepSpeed's memory-efficient linear (zero.Init puts it in place of ``F.linear`` unless the config
    turns it off, as ljperf's engine does for compiled ZeRO-3) a block reads each weight's ``ds_id``: torch 2.11
    guards on it, one recompile per block until ``recompile_limit``. As dynamic ints they cost one recompile."""
    if getattr(torch.nn.functional.linear, "__module__", "") == "deepspeed.runtime.zero.linear":
        torch._dynamo.config.allow_unspec_int_on_nn_module = True


def _forward_resolver(module: torch.nn.Module) -> Callable[[], Callable]:
    own = module.__dict__.get("forward")
    if own is not None:  # an earlier optimization (checkpoint) replaced this module's forward: compile that
        return lambda: own
    return lambda: types.MethodType(type(module).forward, module)


def _compile_module(module: torch.nn.Module, *, name: str, group: _Group, sess: CompileSession) -> None:
    if isinstance(module.__dict__.get("forward"), Region):
        raise ValueError(f"{name} is compiled already: compile a model once")
    module.forward = Region(name, _forward_resolver(module), group, sess)
    sess.regions.append(name)


@overload
def compile_model(
    model: torch.nn.Module, mode: TorchCompileMode, *, verbose: bool = True, **options: Any
) -> CompileSession: ...
@overload
def compile_model(
    model: torch.nn.Module, mode: CompileMode, *, verbose: bool = True, **options: Any
) -> CompileSession | None: ...
def compile_model(
    model: torch.nn.Module, mode: CompileMode, *, verbose: bool = True, **options: Any
) -> CompileSession | None:
    """Compile ``model`` in place for training (``regional`` or ``whole``); returns the session, None for ``off``.

    ``options`` go to every ``torch.compile`` call (e.g. ``backend``, ``mode``).
    """
    global _session
    if mode not in values_of(CompileMode):
        raise ValueError(f"compile mode {mode!r}: choose one of {', '.join(values_of(CompileMode))}")
    if mode == "off":
        return None
    if mode == "deepspeed":
        raise ValueError("compile mode deepspeed is DeepSpeed's engine.compile(): the deepspeed engine runs it")
    # cast: torch types the attributes a module gets and sets as its tensors and submodules; a transformers model's
    # config and loss function are neither
    hf = cast(Any, model)
    if getattr(hf, "config", None) is not None:
        hf.config.use_cache = False  # a KV cache in the forward's guards would recompile every layer
    # Process-wide: the backward is compiled with the forward, not at the first backward, so a failing backward
    # compile raises inside the region's call, where it can still fall back. (Patching per call costs ~0.2 ms.)
    from torch._functorch import config as functorch_config

    functorch_config.force_non_lazy_backward_lowering = True
    sess = _session = CompileSession(mode=mode, options=options, verbose=verbose)
    names = {id(m): n for n, m in model.named_modules()}
    if mode == "whole":
        _compile_module(model, name="model", group=_Group("model"), sess=sess)
        return sess
    try:
        blocks = find_blocks(model)
    except UsageError:  # no repeated blocks: the model is the one region
        blocks = [model]
    groups: dict[type, _Group] = {}
    for block in blocks:
        kind = type(block)
        label = f"{kind.__name__} blocks" if sum(type(b) is kind for b in blocks) > 1 else names[id(block)]
        _compile_module(
            block, name=names[id(block)] or "model", group=groups.setdefault(kind, _Group(label)), sess=sess
        )
    if hasattr(type(model), "loss_function"):
        loss = hf.loss_function
        hf.loss_function = Region("loss", lambda: loss, _Group("loss"), sess)
        sess.regions.append("loss")
    return sess


def compile_deepspeed_engine(engine: Any, *, verbose: bool) -> CompileSession:
    """``engine.compile()``: DeepSpeed compiles the whole module, its ZeRO hooks included (with DeepCompile,
    enabled by the config's ``compile.deepcompile``, its graph passes replace the hooks). Errors fall back to
    eager: at ``compile()`` with a one-line reason, inside a graph through dynamo's ``suppress_errors``."""
    global _session
    from torch._functorch import config as functorch_config

    functorch_config.force_non_lazy_backward_lowering = True
    torch._dynamo.config.suppress_errors = True
    sess = _session = CompileSession(
        mode="deepspeed", options={"deepcompile": engine.is_deepcompile_enabled()}, verbose=verbose, external="model"
    )
    sess.regions.append("model")
    try:
        engine.compile()
    except Exception as exc:
        if (stop := interruption(exc)) is not None:
            raise stop from None
        sess.fallback("model", exc)
    # Whether DeepCompile runs, not whether the config asked for it: a failed compile() leaves it off.
    sess.options["deepcompile"] = bool(getattr(engine, "is_deepcompile_active", engine.is_deepcompile_enabled)())
    return sess


def zero3_gather_per_block(model: torch.nn.Module) -> None:
    """Make each decoder block one ZeRO-3 unit of parameter gathering (a "leaf module").

    DeepSpeed then hooks the block, not every Linear inside it, so no gather hook (and no ``ds_id``
    guard) sits inside a compiled block and the block's parameters arrive in one all-gather.
    """
    from deepspeed.utils import set_z3_leaf_modules

    try:
        classes = list({type(block): None for block in find_blocks(model)})
    except UsageError:
        return
    set_z3_leaf_modules(model, classes)
