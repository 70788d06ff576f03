"""``CHECKPOINT_OPTIMIZATION=true``: the fastest recompute plan under the memory budget, in an unchanged
HF Trainer or DeepSpeed script.

Run: ``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=70GiB python train.py`` (docs/checkpoint.md).
``Trainer.__init__`` and ``deepspeed.initialize`` are patched when imported; they attach a forward pre-hook
to the model that plans from the first training batch's shape (and again when a batch is larger), applies
the plan before that forward and logs one line. Any failure warns once and removes the hook: training goes
on exactly as without the variable.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ljperf.hooks.imports import when_imported

PREFIX = "[ljperf]"


def register() -> None:
    when_imported("transformers.trainer", _patch_trainer)
    when_imported("deepspeed", _patch_deepspeed)


def _patch_trainer(module: ModuleType) -> None:
    cls = module.Trainer
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _guarded(lambda: attach(self.model, lambda: _trainer_setup(self)))

    cls.__init__ = __init__


def _trainer_setup(trainer) -> dict[str, Any]:
    args = trainer.args
    setup = {
        "engine": "fsdp" if args.fsdp else "torch",
        "world": args.world_size,
        "precision": "bf16-mixed" if args.bf16 else "fp32",
        "grad_accum": args.gradient_accumulation_steps,
    }
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is not None:
        setup |= {"engine": "deepspeed", "zero_stage": ds.config.get("zero_optimization", {}).get("stage", 0)}
    return setup


def _patch_deepspeed(module: ModuleType) -> None:
    original = module.initialize

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any):
        result = original(*args, **kwargs)
        engine = result[0]
        _guarded(lambda: attach(engine.module, lambda: _deepspeed_setup(engine)))
        return result

    module.initialize = initialize


def _deepspeed_setup(engine) -> dict[str, Any]:
    return {
        "engine": "deepspeed",
        "zero_stage": max(engine.zero_optimization_stage(), 1),
        "world": engine.dp_world_size,
        "precision": "bf16-mixed" if engine.bfloat16_enabled() else "fp32",
        "grad_accum": engine.gradient_accumulation_steps(),
    }


def attach(model, setup: Callable[[], dict[str, Any]]) -> None:
    """Plan at the model's first training forward (and when a batch is larger); once per model."""
    import torch

    if getattr(model, "_ljperf_checkpoint_hook", None) is not None:
        return  # a Trainer running DeepSpeed attaches once, from Trainer.__init__
    planned = {"tokens": 0}

    @torch._dynamo.disable
    def pre_forward(module, args, kwargs):
        shape = _batch_shape(args, kwargs)
        if shape is None or not module.training or shape[0] * shape[1] <= planned["tokens"]:
            return
        try:
            decision = plan_model(module, micro_batch=shape[0], seq_len=shape[1], **setup())
            from ljperf.checkpoint.apply import apply_plan

            apply_plan(module, decision.plan)
            planned["tokens"] = shape[0] * shape[1]
            log(decision.line())
        except Exception as exc:
            handle.remove()
            model._ljperf_checkpoint_hook = None
            warnings.warn(f"ljperf: CHECKPOINT_OPTIMIZATION left training unchanged: {exc}", stacklevel=2)

    handle = model.register_forward_pre_hook(pre_forward, with_kwargs=True)
    model._ljperf_checkpoint_hook = handle


def _batch_shape(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    import torch

    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    return None


def plan_model(model, *, micro_batch: int, seq_len: int, world: int, precision: str, **recipe: Any):
    """The solver's decision for this HF model at this batch shape (budget: ``LJPERF_MEMORY_BUDGET`` or device)."""
    import torch

    from ljperf.checkpoint.solver import Rates, budget_bytes, solve_recipe
    from ljperf.forecast import Recipe
    from ljperf.models import ModelSpec

    config = model.config
    spec = ModelSpec(name=getattr(config, "name_or_path", "") or type(model).__name__, config=config)
    device = next(model.parameters()).device
    if device.type == "meta":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else device
    device_type = "cuda" if device.type == "cuda" else "cpu"
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    full = Recipe(
        device=device_type,
        world=world,
        precision=precision,
        micro_batch=micro_batch,
        seq_len=seq_len,
        attn_implementation=attn if attn in ("sdpa", "eager") else "sdpa",
        **recipe,
    )
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    budget = budget_bytes(
        torch.device(device_type, device.index) if device_type == "cuda" else device, local_world=local_world
    )
    rates = Rates.measure(torch.device(device_type, device.index) if device_type == "cuda" else torch.device("cpu"))
    return solve_recipe(spec, full, budget=budget, rates=rates)


def log(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"{PREFIX} {line}", file=sys.stderr, flush=True)


def _guarded(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:
        warnings.warn(f"ljperf: CHECKPOINT_OPTIMIZATION left training unchanged: {exc}", stacklevel=3)
