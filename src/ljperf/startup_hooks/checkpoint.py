"""``CHECKPOINT_OPTIMIZATION=true``: the fastest recompute plan under the memory budget, in an unchanged
HF Trainer, DeepSpeed or FSDP2 script.

Run: ``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=70GiB python train.py`` (docs/checkpoint.md).
``Trainer.__init__``, ``deepspeed.initialize`` and FSDP2's ``fully_shard`` (when called on an HF model, the
root) are patched when imported; they attach a forward pre-hook to the model that plans from the first
training batch's shape (and again when a batch is larger), applies the plan before that forward and logs one
line; a script's own gradient checkpointing (``gradient_checkpointing=True``) is replaced by the plan, and the
line says so. Ranks plan with rank 0's budget and device rates; under ZeRO-3 every rank plans for the largest batch
of any rank, so all run one plan (``_agreed``). The second training step's peak is measured and, when it
misses the forecast, the plan is corrected once (the closed loop, ``checkpoint_planner._Planner``): under ZeRO-3
from the largest peak of any rank, elsewhere by each rank from its own. When even full recompute cannot fit, the
cheapest plan at the lowest peak runs (``solver.solve``) and one warning says what would fit. Any failure warns once
and removes the hook: training goes on exactly as without the variable. Models ljperf builds are left alone: there
``CHECKPOINT_OPTIMIZATION=true`` makes ``ljperf benchmark`` default to ``--recompute auto``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeGuard

from ljperf.startup_hooks.messages import warn
from ljperf.startup_hooks.post_import import when_imported

if TYPE_CHECKING:  # the hook imports ljperf's planning code only when it plans
    import torch
    from transformers import PreTrainedModel, Trainer

_PATCHED = "_ljperf_checkpoint"
"""The mark on a function this hook has wrapped."""


def register() -> None:
    when_imported("transformers.trainer", _patch_trainer)
    when_imported("deepspeed", _patch_deepspeed)
    when_imported("torch.distributed.fsdp", _patch_fsdp)


def _patch(owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``wrap(original)``, once (the hook may be registered twice)."""
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return
    wrapper = functools.wraps(original)(wrap(original))
    setattr(wrapper, _PATCHED, True)
    setattr(owner, name, wrapper)


def _attach(model: torch.nn.Module | None, setup: str, *args: Any, holders: list | None = None) -> None:
    """Plan ``model`` from its first training forward (``checkpoint_planner.attach``), its recipe read by
    ``checkpoint_planner.<setup>(*args)``; any failure warns once and leaves training as it is. The planner imports
    torch and ljperf's forecast: by now the script has imported torch (and transformers, DeepSpeed or FSDP2)."""
    try:
        from ljperf.startup_hooks import checkpoint_planner as planner

        if model is None:
            raise ValueError("there is no model to plan")
        planner.attach(model, functools.partial(getattr(planner, setup), *args), holders=holders)
    except Exception as exc:
        warn(f"CHECKPOINT_OPTIMIZATION left training unchanged: {exc}")


def _patch_trainer(module: ModuleType) -> None:
    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if self.model is None:  # model_init: the Trainer makes its model in train()
                warn("CHECKPOINT_OPTIMIZATION left training unchanged: the Trainer has no model yet (model_init)")
            else:
                _attach(self.model, "trainer_setup", self)

        return __init__

    _patch(module.Trainer, "__init__", wrap)


def _patch_deepspeed(module: ModuleType) -> None:
    def wrap(original: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
        def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
            result = original(*args, **kwargs)
            engine = result[0]
            _attach(engine.module, "deepspeed_setup", engine, holders=[engine.optimizer])
            return result

        return initialize

    _patch(module, "initialize", wrap)


def _patch_fsdp(module: ModuleType) -> None:
    # The root call: the user shards the decoder layers first, then the whole model, then trains.
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def fully_shard(target: torch.nn.Module | list[torch.nn.Module], *args: Any, **kwargs: Any) -> Any:
            result = original(target, *args, **kwargs)
            if _is_hf_model(target):
                _attach(target, "fsdp_setup", target, kwargs)
            return result

        return fully_shard

    _patch(module, "fully_shard", wrap)


def _is_hf_model(obj: Any) -> TypeGuard[PreTrainedModel]:
    modeling = sys.modules.get("transformers.modeling_utils")  # not imported: not an HF model
    return modeling is not None and isinstance(obj, modeling.PreTrainedModel)
