"""Memory forecast: the peak bytes per rank of a training recipe, before anything runs.

Run: ``ljperf plan --model torch/llama3-8b --gpus 8 --micro-batch 1 --seq-len 8192`` (docs/forecast.md).

API (stable; ``plan``, ``benchmark`` and the checkpoint optimization's solver use ``forecast``):

- ``Recipe`` (keyword-only dataclass): engine, zero_stage, world, device, precision, micro_batch, seq_len,
  grad_accum, attn_implementation, reshard_after_forward, ``recompute`` (one of none/full/selective per
  decoder layer), optimizer (AdamW implementation, default what torch picks).
- ``forecast(spec, recipe) -> Forecast``: ``peak_allocated_bytes``, ``peak_reserved_bytes`` (CUDA),
  ``context_bytes``, ``breakdown`` (bytes per component at the peak), ``phase`` (where the peak is), ``source``.
- ``layer_costs(spec, recipe) -> {mode: LayerCost}``: per decoder layer and recompute mode, the activation
  bytes it keeps until its backward; cheap once traced (the recompute benchmark and the tests read it).
- Recompute modes are traced through ``ljperf.checkpoint.policies`` (what the engines run).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ljperf.forecast.api import LayerCost, forecast, layer_costs
    from ljperf.forecast.recipe import Forecast, Recipe

__all__ = ["Forecast", "LayerCost", "Recipe", "forecast", "layer_costs"]

_HOME = {"Forecast": "recipe", "Recipe": "recipe", "LayerCost": "api", "forecast": "api", "layer_costs": "api"}


def __getattr__(name: str) -> Any:
    # Imported when first used: the tracer imports torch, and a command's flags (``--help``, a typo) need none.
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
