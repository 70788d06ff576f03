"""Models with real or fake weights from a ``ModelSpec``: copies of picked layers, seeded initial values the same
on every engine and rank, materializing and casting parameters.

Run: ``materialize(build_meta(spec), device=torch.device("cpu"), seed=0)``.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ljperf.models.layout import decoder_layers
from ljperf.models.spec import ModelSpec, build_meta, with_layers

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

M = TypeVar("M", bound="torch.nn.Module")
"""A model, returned as it was given (the same object, its parameters replaced)."""


def build_picked(spec: ModelSpec, pick: Sequence[int], *, attn_implementation: str | None = None) -> PreTrainedModel:
    """A copy of ``spec``'s model on the meta device whose decoder layers are the full model's layers ``pick``:
    where layers differ (DeepSeek-V3's first three dense, then mixtures of experts), a copy of the right ones,
    which no config of fewer layers builds."""
    model = build_meta(with_layers(spec, len(pick), pick=pick), attn_implementation=attn_implementation)
    full = decoder_layers(_full_meta(spec, attn_implementation))
    layers = decoder_layers(model)
    for j, i in enumerate(pick):
        layers[j] = copy.deepcopy(full[i])
        for module in layers[j].modules():  # indexes the copy's per-layer config entries, as its own layers do
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = cast(Any, j)  # torch's stub of Module.__setattr__ takes modules and tensors
    return model


_FULL: dict[str, PreTrainedModel] = {}


def _full_meta(spec: ModelSpec, attn_implementation: str | None) -> PreTrainedModel:
    """The full-depth meta build ``build_picked`` copies layers from, kept for the process's later copies."""
    key = json.dumps([spec.facts.config_dict, attn_implementation], sort_keys=True, default=str)
    if key not in _FULL:
        _FULL.clear()  # one model at a time: a solver or plan traces one
        _FULL[key] = build_meta(spec, attn_implementation=attn_implementation)
    return _FULL[key]


def init_seed(seed: int, name: str) -> int:
    """The RNG seed of one parameter: fixed by the run's seed and the parameter's name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_value(name: str, shape: torch.Size, *, std: float, seed: int, device: torch.device) -> torch.Tensor:
    """The initial value of a parameter, the same on every engine, rank and wrapper.

    Matrices are N(0, std) from a generator seeded by (seed, name); 1-D weights (norms) are ones; biases zeros.
    """
    import torch

    if name.endswith("bias"):
        return torch.zeros(shape, device=device)
    if len(shape) == 1:
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(init_seed(seed, name))
    return torch.randn(shape, generator=gen, device=device) * std


def parameter_slots(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """(module, attribute, parameter) for every place a parameter sits; a tied weight sits in several."""
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None:
                yield module, key, param


def replace_parameters(
    model: torch.nn.Module,
    make: Callable[[torch.nn.Module, str, torch.nn.Parameter], torch.nn.Parameter],
    *,
    only_meta: bool = False,
) -> None:
    """Put ``make(module, attribute, parameter)`` in place of each parameter (of each meta one if ``only_meta``).

    ``make`` runs once per parameter and every place it sits gets the result, so tied weights stay tied.
    """
    new: dict[int, torch.nn.Parameter] = {}
    for module, key, param in parameter_slots(model):
        if only_meta and not param.is_meta:
            continue
        if id(param) not in new:
            new[id(param)] = make(module, key, param)
        module._parameters[key] = new[id(param)]


def materialize(model: M, *, device: torch.device, seed: int, dtype: torch.dtype | None = None) -> M:
    """Replace meta parameters with seeded random values on ``device`` (fp32, or ``dtype``: the fp32 values
    rounded); keeps tied weights tied."""
    import torch

    std = float(getattr(model.config, "initializer_range", 0.02))
    names = {id(p): n for n, p in model.named_parameters()}

    def make(_module: torch.nn.Module, _key: str, param: torch.nn.Parameter) -> torch.nn.Parameter:
        with torch.no_grad():
            value = init_value(names[id(param)], param.shape, std=std, seed=seed, device=device)
        return torch.nn.Parameter(value.to(dtype or value.dtype), requires_grad=param.requires_grad)

    replace_parameters(model, make)
    return model.to(device)


def cast_parameters(model: M, dtype: torch.dtype) -> M:
    """The parameters in ``dtype`` (on any device, meta included); buffers keep theirs (RoPE's fp32 frequencies),
    as ``materialize`` leaves them and as a model loaded in bfloat16 keeps them."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
    return model
