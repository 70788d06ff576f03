"""The closed sets of values ljperf's flags and configurations take, each defined once as a ``Literal`` type.

Run: ``values_of(Precision)`` → ``("fp32", "bf16-mixed", "bf16")``. The CLI's metavars, help texts and checks
(``core.options``) and the configurations' fields derive from these types, so a new value is added here alone and
the type checker finds the places that must handle it.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, NoReturn

from ljperf.core.errors import UsageError

EngineName = Literal["torch", "fsdp", "deepspeed"]
"""The training engines (``engines/``): one device or DDP, FSDP2, DeepSpeed ZeRO; ``--model ENGINE/NAME``."""

DeviceType = Literal["cpu", "cuda"]
"""A device a run trains on (``torch.device.type``)."""

Device = Literal[DeviceType, "auto"]
"""What ``--device`` asks for: a device type, or auto (cuda when available)."""

Precision = Literal["fp32", "bf16-mixed", "bf16"]
"""fp32; bf16-mixed (fp32 master weights, bf16 autocast); bf16 (bf16 weights, gradients and AdamW states)."""

Loss = Literal["plain", "chunked"]
"""The next-token loss: HF's over the whole logits, or the LM head and cross-entropy chunk by chunk."""

OptimizerImpl = Literal["single", "foreach", "fused"]
"""torch's AdamW implementations: a loop over tensors, a few kernels over lists of them, one fused kernel."""

TracedAttention = Literal["sdpa", "eager"]
"""The transformers attention implementations the memory forecast traces (on fake tensors, on a CPU)."""

Attention = Literal[TracedAttention, "flash_attention_2"]
"""The transformers attention implementations ljperf runs (flash_attention_2: CUDA and the flash-attn package)."""

TorchCompileMode = Literal["regional", "whole"]
"""How ljperf calls ``torch.compile``: each block and the loss, or the whole model."""

CompileMode = Literal[TorchCompileMode, "deepspeed", "off"]
"""``--compile-mode``: ljperf's ``torch.compile``, DeepSpeed's ``engine.compile()``, or eager."""


PipelineSchedule = Literal["1f1b", "gpipe", "interleaved-1f1b"]
"""``torch.distributed.pipelining``'s schedules ljperf runs: one forward one backward, all forwards then all
backwards, and 1F1B over several stages a rank (``--pp-stages-per-rank``)."""


def values_of(kind: object) -> tuple[Any, ...]:
    """The values of the ``Literal`` type ``kind`` (an optional one's too: ``Precision | None``), in its order; ()
    for any other type. Typed as ``typing.get_args``: annotate a tuple kept of them (``tuple[Precision, ...]``),
    and ``value in`` it narrows ``value`` to the type."""
    if typing.get_origin(kind) is Literal:
        return typing.get_args(kind)
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return next((typing.get_args(m) for m in typing.get_args(kind) if typing.get_origin(m) is Literal), ())
    return ()


def refuse(what: str, value: object, kind: object) -> NoReturn:
    """Raise the usage error of ``value`` for ``what`` (a flag or a field), which is not one of ``kind``'s values."""
    raise UsageError(f"{what} {value!r}: choose one of {', '.join(values_of(kind))}")


def check_choice(what: str, value: object, kind: object) -> None:
    """Refuse ``value`` (for ``what``) unless it is one of ``kind``'s values: values from the type checker's blind
    spots (flags, files, other tools' configs) are checked where they enter. To narrow ``value`` to the type as
    well, test it against a typed tuple (``if value not in PRECISIONS: refuse(...)``)."""
    if value not in values_of(kind):
        refuse(what, value, kind)


PRECISIONS: tuple[Precision, ...] = values_of(Precision)
TRACED_ATTENTION: tuple[TracedAttention, ...] = values_of(TracedAttention)
DEVICE_TYPES: tuple[DeviceType, ...] = values_of(DeviceType)
TORCH_COMPILE_MODES: tuple[TorchCompileMode, ...] = values_of(TorchCompileMode)
