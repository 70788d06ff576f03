"""The changes the forecast makes to transformers while it runs a model on fake tensors, one named entry each,
so that the fake step takes the code path a real step takes.

Run: ``with real_code_paths(): model(...)`` (the trace, the recompute cost and ``benchmark.fakestep`` do). Each
``Patch`` says why it exists and the transformers versions it was checked on; ``swapped`` sets an attribute for
the length of a ``with`` and puts the original back, whatever happens inside.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch


@contextlib.contextmanager
def swapped(owner: object, name: str, value: object) -> Generator[None, None, None]:
    """``owner.name`` is ``value`` inside the ``with``; the original afterwards."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One attribute of a transformers module replaced while a fake step runs."""

    name: str
    module: str
    """The module that owns the attribute (an older transformers without it: the patch is skipped)."""
    attribute: str
    replacement: Callable[[Any, Any], Any]
    """``(module, original) → the value to put in its place``, or None where this transformers needs no patch."""
    why: str
    checked_on: tuple[str, ...]
    """transformers versions this was checked on."""

    def applied(self) -> contextlib.AbstractContextManager:
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            return contextlib.nullcontext()
        original = getattr(module, self.attribute, None)
        value = None if original is None else self.replacement(module, original)
        return contextlib.nullcontext() if value is None else swapped(module, self.attribute, value)


def _no_packed_sequences(_module: Any, _original: Any) -> Callable[..., None]:
    return lambda *args, **kwargs: None


def _bf16_only(_module: Any, can_use: Callable[..., bool]) -> Callable[..., bool]:
    def bf16_only(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        return can_use(input, weight, offs) and input.dtype == weight.dtype == torch.bfloat16

    return bf16_only


def _grouped_mm_without_values(module: Any, grouped_mm: Callable[..., torch.Tensor]) -> Callable[..., Any] | None:
    if hasattr(module, "_grouped_mm_fallback_bwd") or not hasattr(module, "_can_use_grouped_mm"):
        return None  # transformers' fallback has a backward op of its own, which fake tensors run

    def without_values(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if module._can_use_grouped_mm(input, weight, offs):  # the patched check: bf16 only
            return grouped_mm(input, weight, offs)
        return FallbackGroupedMM.apply(input.to(weight.dtype), weight, offs)

    return without_values


PATCHES = (
    Patch(
        name="no packed sequences",
        module="transformers.masking_utils",
        attribute="find_packed_sequence_indices",
        replacement=_no_packed_sequences,
        why="a real run passes no position ids, so transformers finds no packed sequences and lets SDPA skip the"
        " causal mask; on fake tensors it cannot read the values and would build the mask (and repeat K/V)",
        checked_on=("5.17", "5.24", "5.25"),
    ),
    Patch(
        name="grouped_mm on bf16 only",
        module="transformers.integrations.moe",
        attribute="_can_use_grouped_mm",
        replacement=_bf16_only,
        why="torch's fake grouped_mm takes bf16 only (it checks as the CUDA kernel does) while the CPU kernel runs"
        " fp32, so fp32 experts run transformers' own fallback op: same output, same tensors saved for backward",
        checked_on=("5.17", "5.24", "5.25"),
    ),
    Patch(
        name="fallback grouped_mm without values",
        module="transformers.integrations.moe",
        attribute="_grouped_mm",
        replacement=_grouped_mm_without_values,
        why="before the fallback op's backward was an op of its own (5.17 has none) it read the offsets' values,"
        " which fake tensors do not have: FallbackGroupedMM stands in, with the same tensors saved and allocated",
        checked_on=("5.17",),
    ),
)


@contextlib.contextmanager
def real_code_paths() -> Generator[None, None, None]:
    """Every ``PATCHES`` entry that applies to this transformers, for the length of the ``with``. The experts'
    rows are tokens × top-k whatever the routing, so what they keep does not depend on the data."""
    with contextlib.ExitStack() as stack:
        for patch in PATCHES:
            stack.enter_context(patch.applied())
        yield


class FallbackGroupedMM(torch.autograd.Function):
    """transformers' ``grouped_mm_fallback`` op as fake tensors run it: output (tokens, out); keeps input,
    weight and the offsets; backward makes a gradient like each (transformers 5.24's backward op, faked, does
    the same). The output is a matmul's, of the same shape and FLOPs, so selective recompute keeps it as it
    keeps the op's."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.offs = offs
        return input @ weight[0]

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        # torch's Function.backward takes the outputs' gradients as *args: none is read (zeros of the inputs' shapes)
        input, weight = ctx.saved_tensors
        return torch.zeros_like(input), torch.zeros_like(weight), None
