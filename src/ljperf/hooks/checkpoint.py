"""``CHECKPOINT_OPTIMIZATION=true``: the fastest recompute plan under the memory budget, in an unchanged
HF Trainer, DeepSpeed or FSDP2 script.

Run: ``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=70GiB python train.py`` (docs/checkpoint.md).
``Trainer.__init__``, ``deepspeed.initialize`` and FSDP2's ``fully_shard`` (when called on an HF model, the
root) are patched when imported; they attach a forward pre-hook to the model that plans from the first
training batch's shape (and again when a batch is larger), applies the plan before that forward and logs one
line. Ranks plan with rank 0's budget and device rates; under ZeRO-3 every rank plans for the largest batch
of any rank, so all run one plan (``_agreed``). When even full recompute cannot fit,
every layer recomputes and one warning says what would fit. Any failure warns once and removes the hook:
training goes on exactly as without the variable.
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
    when_imported("torch.distributed.fsdp", _patch_fsdp)


def _patch(owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``wrap(original)``, once (the hook may be registered twice)."""
    original = getattr(owner, name)
    if getattr(original, "_ljperf_checkpoint", False):
        return
    wrapper = functools.wraps(original)(wrap(original))
    wrapper._ljperf_checkpoint = True
    setattr(owner, name, wrapper)


def _patch_trainer(module: ModuleType) -> None:
    def wrap(original):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            _guarded(lambda: attach(self.model, lambda: _trainer_setup(self)))

        return __init__

    _patch(module.Trainer, "__init__", wrap)


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
        from ljperf.forecast.recipe import ZeroSettings

        setup |= {
            "engine": "deepspeed",
            "zero_stage": ds.config.get("zero_optimization", {}).get("stage", 0),
            "zero": ZeroSettings.from_config(ds.config),
        }
    return setup


def _patch_deepspeed(module: ModuleType) -> None:
    def wrap(original):
        def initialize(*args: Any, **kwargs: Any):
            result = original(*args, **kwargs)
            engine = result[0]
            _guarded(lambda: attach(engine.module, lambda: _deepspeed_setup(engine)))
            return result

        return initialize

    _patch(module, "initialize", wrap)


def _deepspeed_setup(engine) -> dict[str, Any]:
    from ljperf.forecast.recipe import ZeroSettings

    return {
        "engine": "deepspeed",
        "zero": ZeroSettings(
            reduce_bucket_size=engine.zero_reduce_bucket_size(),
            prefetch_bucket_size=engine.zero_prefetch_bucket_size(),
            max_live_parameters=engine.zero_max_live_parameters(),
            max_reuse_distance=engine.zero_max_reuse_distance(),
        ),
        "zero_stage": max(engine.zero_optimization_stage(), 1),
        "world": engine.dp_world_size,
        "precision": "bf16-mixed" if engine.bfloat16_enabled() else "fp32",
        "grad_accum": engine.gradient_accumulation_steps(),
    }


def _patch_fsdp(module: ModuleType) -> None:
    # The root call: the user shards the decoder layers first, then the whole model, then trains.
    def wrap(original):
        def fully_shard(target, *args: Any, **kwargs: Any):
            result = original(target, *args, **kwargs)
            if _is_hf_model(target):
                _guarded(lambda: attach(target, lambda: _fsdp_setup(kwargs)))
            return result

        return fully_shard

    _patch(module, "fully_shard", wrap)


def _is_hf_model(obj: Any) -> bool:
    modeling = sys.modules.get("transformers.modeling_utils")  # not imported: not an HF model
    return modeling is not None and isinstance(obj, modeling.PreTrainedModel)


def _fsdp_setup(kwargs: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    mesh = kwargs.get("mesh")
    policy = kwargs.get("mp_policy")
    reshard = kwargs.get("reshard_after_forward", True)
    return {
        "engine": "fsdp",
        "world": mesh.size() if mesh is not None else dist.get_world_size(),
        "precision": "bf16-mixed" if getattr(policy, "param_dtype", None) == torch.bfloat16 else "fp32",
        "reshard_after_forward": reshard if isinstance(reshard, bool) else True,
        "grad_accum": 1,  # a plain loop's accumulation is invisible here
    }


def attach(model, setup: Callable[[], dict[str, Any]]) -> None:
    """Plan at the model's first training forward (and when a batch is larger); once per model."""
    import torch

    if getattr(model, "_ljperf_checkpoint_hook", None) is not None:
        return  # a Trainer running DeepSpeed or FSDP2 attaches once, from Trainer.__init__
    planned: dict[str, Any] = {"tokens": 0, "measures": None, "setup": None}

    @torch._dynamo.disable
    def pre_forward(module, args, kwargs):
        ids = _batch_ids(args, kwargs)
        if ids is None or not module.training:
            return
        try:
            if planned["setup"] is None:
                planned["setup"] = setup()
            agreed = _agreed(planned["setup"])
            micro_batch, seq_len = _largest_shape(ids) if agreed else ids.shape[:2]
            if micro_batch * seq_len <= planned["tokens"]:
                return
            decision, planned["measures"] = plan_model(
                module, micro_batch=micro_batch, seq_len=seq_len, measures=planned["measures"], **planned["setup"]
            )
            if agreed:
                from ljperf.checkpoint.solver import shared_from_rank0

                decision = shared_from_rank0(decision)
            from ljperf.checkpoint.apply import apply_plan

            apply_plan(module, decision.plan)
            planned["tokens"] = micro_batch * seq_len
            if decision.fits is False:
                if _is_main():
                    warnings.warn(f"{PREFIX} {decision.line()}", stacklevel=2)
            else:
                log(decision.line())
        except Exception as exc:
            handle.remove()
            model._ljperf_checkpoint_hook = None
            warnings.warn(f"ljperf: CHECKPOINT_OPTIMIZATION left training unchanged: {exc}", stacklevel=2)

    handle = model.register_forward_pre_hook(pre_forward, with_kwargs=True)
    model._ljperf_checkpoint_hook = handle


def _batch_ids(args: tuple, kwargs: dict):
    """The batch's token ids (or embeddings): a tensor whose first two dimensions are (micro batch, sequence)."""
    import torch

    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value
    return None


def _agreed(setup: dict[str, Any]) -> bool:
    """Whether every rank must run the same plan. ZeRO-3 gathers parameters in the order of the module trace it
    recorded, so a rank that recomputes a layer the others do not issues other collectives (gloo aborts with
    "collective mismatch"); ranks of an HF Trainer pad their batches to different lengths. FSDP2, DDP and
    ZeRO-1/2 issue the same collectives whatever each rank recomputes, so each rank plans for its own batch."""
    return setup["engine"] == "deepspeed" and setup.get("zero_stage") == 3 and setup["world"] > 1


def _largest_shape(ids) -> tuple[int, int]:
    """The largest micro batch and sequence length of any rank: one all-reduce of two integers per training
    forward, on the batch's device (so the process group's own backend)."""
    from ljperf.checkpoint.solver import max_over_ranks

    micro_batch, seq_len = max_over_ranks(list(ids.shape[:2]), ids.device)
    return micro_batch, seq_len


def plan_model(
    model,
    *,
    micro_batch: int,
    seq_len: int,
    world: int,
    precision: str,
    measures: tuple | None = None,
    **recipe: Any,
):
    """The solver's decision for this HF model at this batch shape (budget: ``LJPERF_MEMORY_BUDGET`` or device),
    and the (budget, rates) it used: rank 0's, measured on the first call and passed back in on later ones."""
    import torch

    from ljperf.checkpoint.solver import Rates, budget_bytes, shared_from_rank0, solve_recipe
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
    if measures is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        here = torch.device(device_type, device.index) if device_type == "cuda" else torch.device("cpu")
        measures = shared_from_rank0((budget_bytes(here, local_world=local_world), Rates.measure(here)))
    budget, rates = measures
    name = torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu"  # calibrated overheads
    return solve_recipe(spec, full, budget=budget, rates=rates, device_name=name), measures


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def log(line: str) -> None:
    if _is_main():
        print(f"{PREFIX} {line}", file=sys.stderr, flush=True)


def _guarded(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:
        warnings.warn(f"ljperf: CHECKPOINT_OPTIMIZATION left training unchanged: {exc}", stacklevel=3)
