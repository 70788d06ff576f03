"""``CHECKPOINT_OPTIMIZATION=true``: the fastest recompute plan under the memory budget, in an unchanged
HF Trainer, DeepSpeed or FSDP2 script.

Run: ``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=70GiB python train.py`` (docs/checkpoint.md).
``Trainer.__init__``, ``deepspeed.initialize`` and FSDP2's ``fully_shard`` (when called on an HF model, the
root) are patched when imported; they attach a forward pre-hook to the model that plans from the first
training batch's shape (and again when a batch is larger), applies the plan before that forward and logs one
line; a script's own gradient checkpointing (``gradient_checkpointing=True``) is replaced by the plan, and the
line says so. Ranks plan with rank 0's budget and device rates; under ZeRO-3 every rank plans for the largest batch
of any rank, so all run one plan (``_agreed``). The second training step's peak is measured and, when it
misses the forecast, the plan is corrected once (the closed loop, ``_Planner``): under ZeRO-3 from the largest
peak of any rank, elsewhere by each rank from its own. When even full recompute cannot fit, the cheapest plan
at the lowest peak runs (``solver.solve``) and one warning says what would fit. Any failure warns once and
removes the hook: training goes on exactly as without the variable. Models ljperf builds are left alone: there
``CHECKPOINT_OPTIMIZATION=true`` makes ``ljperf benchmark`` default to ``--recompute auto``.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ljperf.hooks.imports import when_imported

if TYPE_CHECKING:  # the hook imports ljperf's planning code only when it plans
    import torch
    from deepspeed import DeepSpeedEngine
    from transformers import Trainer

    from ljperf.checkpoint.solver import Decision, LayerCost, Rates
    from ljperf.forecast.recipe import Recipe
    from ljperf.models import ModelSpec

PREFIX = "[ljperf]"
REPLACES = "replaces the script's gradient_checkpointing=True"


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
    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            _guarded(lambda: attach(self.model, lambda: _trainer_setup(self)))

        return __init__

    _patch(module.Trainer, "__init__", wrap)


def _trainer_setup(trainer: Trainer) -> dict[str, Any]:
    import torch

    args = trainer.args
    mixed = "bf16-mixed" if args.bf16 else "fp32"
    # Loaded in bfloat16: no fp32 master (accelerate's FSDP2 upcasts under bf16 mixed precision before this runs).
    bf16_weights = next(trainer.model.parameters()).dtype == torch.bfloat16
    setup = {
        "engine": "fsdp" if args.fsdp else "torch",
        "world": args.world_size,
        "precision": "bf16" if bf16_weights else mixed,
        "grad_accum": args.gradient_accumulation_steps,
        # Trainer's default is fused AdamW (transformers on torch 2.8+): no step temporaries, where foreach has one
        # copy of the parameters
        "optimizer": optimizer_impl(getattr(trainer, "optimizer", None)),
    }
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is not None:
        from ljperf.forecast.recipe import ZeroSettings

        setup |= {
            "engine": "deepspeed",
            "precision": mixed,  # DeepSpeed keeps fp32 master weights of a bf16 model
            # Stage 0 (DeepSpeed's data parallelism) is planned as ZeRO-1, as ``_deepspeed_setup`` does.
            "zero_stage": max(ds.config.get("zero_optimization", {}).get("stage", 0), 1),
            "zero": ZeroSettings.from_config(ds.config),
        }
    return setup


def _patch_deepspeed(module: ModuleType) -> None:
    def wrap(original: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
        def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
            result = original(*args, **kwargs)
            engine = result[0]
            _guarded(lambda: attach(engine.module, lambda: _deepspeed_setup(engine), holders=[engine.optimizer]))
            return result

        return initialize

    _patch(module, "initialize", wrap)


def _deepspeed_setup(engine: DeepSpeedEngine) -> dict[str, Any]:
    from ljperf.forecast.recipe import ZeroSettings

    return {
        "engine": "deepspeed",
        "zero": ZeroSettings(
            reduce_bucket_size=engine.zero_reduce_bucket_size(),
            prefetch_bucket_size=engine.zero_prefetch_bucket_size(),
            max_live_parameters=engine.zero_max_live_parameters(),
            max_reuse_distance=engine.zero_max_reuse_distance(),
            sub_group_size=engine.zero_sub_group_size(),
            overlap_comm=bool(engine.zero_overlap_comm()),
            contiguous_gradients=bool(engine.zero_contiguous_gradients()),
        ),
        "zero_stage": max(engine.zero_optimization_stage(), 1),
        "world": engine.dp_world_size,
        "precision": "bf16-mixed" if engine.bfloat16_enabled() else "fp32",
        "grad_accum": engine.gradient_accumulation_steps(),
        "optimizer": optimizer_impl(engine.optimizer),
    }


def optimizer_impl(optimizer: Any) -> str | None:
    """The AdamW implementation ``optimizer`` runs, through its wrappers (accelerate's, ZeRO's ``.optimizer``):
    fused, foreach or single; None when it is torch's own pick or not an AdamW ljperf knows."""
    import torch

    for _ in range(4):  # accelerate's wrapper around ZeRO's around torch's: a few levels at most
        if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            if optimizer.defaults.get("fused"):
                return "fused"
            foreach = optimizer.defaults.get("foreach")
            return None if foreach is None else "foreach" if foreach else "single"
        if type(optimizer).__name__ == "FusedAdam":  # DeepSpeed's multi-tensor kernel: updates in place
            return "fused"
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _patch_fsdp(module: ModuleType) -> None:
    # The root call: the user shards the decoder layers first, then the whole model, then trains.
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def fully_shard(target: torch.nn.Module | list[torch.nn.Module], *args: Any, **kwargs: Any) -> Any:
            result = original(target, *args, **kwargs)
            if _is_hf_model(target):
                _guarded(lambda: attach(target, lambda: _fsdp_setup(target, kwargs)))
            return result

        return fully_shard

    _patch(module, "fully_shard", wrap)


def _is_hf_model(obj: Any) -> bool:
    modeling = sys.modules.get("transformers.modeling_utils")  # not imported: not an HF model
    return modeling is not None and isinstance(obj, modeling.PreTrainedModel)


def _fsdp_setup(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    mesh = kwargs.get("mesh")
    policy = kwargs.get("mp_policy")
    reshard = kwargs.get("reshard_after_forward", True)
    if next(model.parameters()).dtype == torch.bfloat16:  # a model loaded in bfloat16: no fp32 master
        precision = "bf16"
    else:
        precision = "bf16-mixed" if getattr(policy, "param_dtype", None) == torch.bfloat16 else "fp32"
    return {
        "engine": "fsdp",
        "world": mesh.size() if mesh is not None else dist.get_world_size(),
        "precision": precision,
        "reshard_after_forward": reshard if isinstance(reshard, bool) else True,
        "grad_accum": 1,  # a plain loop's accumulation is invisible here
    }


def attach(model: torch.nn.Module, setup: Callable[[], dict[str, Any]], *, holders: list | None = None) -> None:
    """Plan at the model's first training forward (and when a batch is larger), then correct the plan once
    from the measured peak of the second training step (the closed loop); once per model. ``holders``: objects
    whose tensors live between steps outside the model and its optimizer's state (DeepSpeed's optimizer)."""
    if getattr(model, "_ljperf_built", False):
        return  # ljperf benchmark's own model: CHECKPOINT_OPTIMIZATION made --recompute auto there
    planner = getattr(model, "_ljperf_checkpoint_hook", None)
    if planner is None:  # a Trainer running DeepSpeed or FSDP2 attaches once, from Trainer.__init__
        planner = model._ljperf_checkpoint_hook = _Planner(model, setup)
    planner.holders += holders or []


class _Planner:
    """The hook's state for one model: the plan running, the shape it is for, and the closed loop.

    The closed loop measures the second training step (the first creates the optimizer states), from its first
    training forward to the first one after its optimizer step: ``torch.cuda.max_memory_allocated`` on CUDA,
    live tensor bytes on CPU. At that forward each rank compares its measured peak (under ZeRO-3, whose ranks
    plan for the largest batch of any rank, the largest peak of any rank) with the forecast of the plan at the
    largest batch of the step, and when it is over the budget or under 85% of the forecast, re-plans with the
    corrected activation coefficient (``solver.corrected_scale``), as ``ljperf benchmark`` does. Under ZeRO-3
    rank 0's verdict is every rank's; elsewhere a rank whose verdict differs from rank 0's logs its own line.
    """

    def __init__(self, model: torch.nn.Module, setup: Callable[[], dict[str, Any]]):
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.model, self.make_setup = model, setup
        self.setup: dict[str, Any] | None = None
        self.measures: tuple | None = None  # rank 0's (budget, rates), measured at the first plan
        self.decision = None
        self.shape = (0, 0)
        self.activation_scale = 1.0
        self.warned = False  # that no plan fits
        self.steps = 0  # training steps whose optimizer has stepped
        self.forwards = 0  # training forwards since the last step
        self.optimizer = None
        self.holders: list = []
        self.window: _Window | None = None
        self.forward_handle = model.register_forward_pre_hook(torch._dynamo.disable(self.pre_forward), with_kwargs=True)
        self.step_handle = register_optimizer_step_post_hook(self.after_step)

    def after_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Counted once per training step: ZeRO-3 steps its optimizer once per parameter sub-group.
        if self.forwards:
            self.steps, self.forwards, self.optimizer = self.steps + 1, 0, optimizer

    def pre_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch

        ids = _batch_ids(args, kwargs)
        if ids is None:
            return
        if not (module.training and torch.is_grad_enabled()):
            if self.window is not None:  # evaluation or generation: measure a later training step instead
                self.window.close()
                self.window = None
            return
        try:
            self.forwards += 1
            if self.setup is None:
                self.setup = self.make_setup()
            shape = _largest_shape(ids) if _agreed(self.setup) else tuple(ids.shape[:2])
            self.measure(shape, ids.device)
            if shape[0] * shape[1] > self.shape[0] * self.shape[1]:
                self.plan(shape)
        except Exception as exc:
            self.remove()
            warn(f"ljperf: CHECKPOINT_OPTIMIZATION left training unchanged: {exc}")

    def plan(
        self, shape: tuple[int, int], *, prefix: str = "", cost: LayerCost | None = None, rank_local: bool = False
    ) -> None:
        from ljperf.checkpoint.apply import apply_plan
        from ljperf.checkpoint.solver import shared_from_rank0

        decision, self.measures = plan_model(
            self.model,
            micro_batch=shape[0],
            seq_len=shape[1],
            measures=self.measures,
            activation_scale=self.activation_scale,
            cost=cost,
            **self.setup,
        )
        if _agreed(self.setup):
            decision = shared_from_rank0(decision)
        replaces = self.decision is None and _script_checkpoints(self.model)
        apply_plan(self.model, decision.plan)
        self.decision, self.shape = decision, shape
        line = prefix + decision.line() + (f" ({REPLACES})" if replaces else "")
        if decision.fits is False and not self.warned:  # once: re-plans for longer batches log their lines
            self.warned = True
            if _is_main():
                warn(f"{PREFIX} {line}")
        else:
            log(line, rank_local=rank_local)

    def measure(self, shape: tuple[int, int], device: torch.device) -> None:
        """Open the window at the second step's first training forward, widen it to each forward's batch, and
        close the loop at the first forward after that step."""
        if self.decision is None or self.steps == 0 or self.step_handle is None:
            return
        if self.window is None:
            self.window = _Window(device, self._state_tensors(), step=self.steps)
        if self.steps == self.window.step:
            self.window.widen(shape)
            return
        self.step_handle.remove()
        self.step_handle = None
        measured = self.window.close()
        if _agreed(self.setup):  # the shape is every rank's largest, so the peak is too
            from ljperf.checkpoint.solver import max_over_ranks

            (measured,) = max_over_ranks([measured], device)
        self.close_loop(measured, self.window.shape)

    def close_loop(self, measured: int, shape: tuple[int, int]) -> None:
        from ljperf.checkpoint.solver import judge_plan, loop_line, shared_from_rank0

        spec, recipe, _, name = model_recipe(self.model, micro_batch=shape[0], seq_len=shape[1], **self.setup)
        scale, first_peak = judge_plan(spec, recipe, self.decision, measured=measured, device_name=name)
        rank0 = shared_from_rank0(scale)
        if _agreed(self.setup):  # every rank measured the largest peak; one verdict keeps one plan
            scale = rank0
        line = loop_line(measured=measured, forecast=first_peak, scale=scale)
        own_verdict = (scale is None) != (rank0 is None)  # this rank alone re-plans, or alone keeps its plan
        if scale is None:
            log(line, rank_local=own_verdict)
            return
        self.activation_scale = scale
        self.plan(self.shape, prefix=line, cost=self.decision.cost, rank_local=own_verdict)

    def _state_tensors(self) -> list:
        """What lives between steps, for the CPU measurement (ZeRO-3 keeps its partitions in ``ds_tensor``)."""
        from ljperf.memory import reachable_tensors, training_state_tensors

        partitions = [p.ds_tensor for p in self.model.parameters() if getattr(p, "ds_tensor", None) is not None]
        held = [t for holder in self.holders for t in reachable_tensors(holder)]
        return training_state_tensors(self.model, self.optimizer) + partitions + held

    def remove(self) -> None:
        for handle in (self.forward_handle, self.step_handle):
            if handle is not None:
                handle.remove()
        if self.window is not None:
            self.window.close()
        self.model._ljperf_checkpoint_hook = None


class _Window:
    """The peak allocated bytes from its opening: CUDA's allocator counters, or live tensors on CPU."""

    def __init__(self, device: torch.device, alive: list, *, step: int):
        from ljperf.memory import LiveTensorBytes, reset_cuda_peak

        self.device, self.step, self.shape = device, step, (0, 0)
        self.tracker, self.peak = None, 0
        if device.type == "cuda":
            reset_cuda_peak(device)
        else:
            self.tracker = LiveTensorBytes(alive)
            self.tracker.__enter__()

    def widen(self, shape: tuple[int, int]) -> None:
        if shape[0] * shape[1] > self.shape[0] * self.shape[1]:
            self.shape = shape

    def close(self) -> int:
        """The peak since opening; a CPU window stops tracking (closing twice is harmless)."""
        from ljperf.memory import cuda_peaks

        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.peak, self.tracker = self.tracker.peak, None
        return cuda_peaks(self.device)[0] if self.device.type == "cuda" else self.peak


def _script_checkpoints(model: torch.nn.Module) -> bool:
    """Whether the script turned HF gradient checkpointing on itself (``TrainingArguments(gradient_checkpointing=
    True)``, ``model.gradient_checkpointing_enable()``): a layer checkpoints that no ljperf plan set."""
    from ljperf.checkpoint.apply import find_blocks

    return any(
        getattr(block, "gradient_checkpointing", False) and not hasattr(block, "_ljperf_recompute")
        for block in find_blocks(model)
    )


def _batch_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
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


def _largest_shape(ids: torch.Tensor) -> tuple[int, int]:
    """The largest micro batch and sequence length of any rank: one all-reduce of two integers per training
    forward, on the batch's device (so the process group's own backend)."""
    from ljperf.checkpoint.solver import max_over_ranks

    micro_batch, seq_len = max_over_ranks(list(ids.shape[:2]), ids.device)
    return micro_batch, seq_len


def model_recipe(
    model: torch.nn.Module, *, micro_batch: int, seq_len: int, world: int, precision: str, **recipe: Any
) -> tuple[ModelSpec, Recipe, torch.device, str]:
    """The forecast's view of training this HF model at this batch shape: (spec, recipe, the torch device,
    the name its forecast overheads are calibrated under)."""
    import torch
    from transformers import PreTrainedModel

    from ljperf.errors import UsageError
    from ljperf.forecast import Recipe
    from ljperf.hardware import calibration_name
    from ljperf.models import ModelSpec, decoder_layers

    if not isinstance(model, PreTrainedModel):
        raise UsageError(f"{type(model).__name__} is not an HF model: plans are made for HF causal LMs")
    decoder_layers(model)  # one the forecast can trace (Llama's layout), or a UsageError that says so
    config = model.config
    spec = ModelSpec.of(config, name=getattr(config, "name_or_path", "") or type(model).__name__)
    device = next(model.parameters()).device
    if device.type == "meta":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else device
    device = torch.device("cuda", device.index) if device.type == "cuda" else torch.device("cpu")
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    full = Recipe(
        device=device.type,
        world=world,
        precision=precision,
        micro_batch=micro_batch,
        seq_len=seq_len,
        attn_implementation=attn if attn in ("sdpa", "eager") else "sdpa",
        **recipe,
    )
    return spec, full, device, calibration_name(device)


def plan_model(
    model: torch.nn.Module,
    *,
    micro_batch: int,
    seq_len: int,
    measures: tuple | None = None,
    activation_scale: float = 1.0,
    cost: LayerCost | None = None,
    **setup: Any,
) -> tuple[Decision, tuple[int, Rates]]:
    """The solver's decision for this HF model at this batch shape (budget: ``LJPERF_MEMORY_BUDGET`` or device),
    and the (budget, rates) it used: rank 0's, measured on the first call and passed back in on later ones.
    ``cost``: the per-layer recompute cost at this shape when already traced (a re-plan at the same shape)."""
    from ljperf.checkpoint.solver import Rates, budget_bytes, shared_from_rank0, solve_recipe
    from ljperf.runtime import local_world_size

    spec, recipe, device, name = model_recipe(model, micro_batch=micro_batch, seq_len=seq_len, **setup)
    if measures is None:
        measures = shared_from_rank0((budget_bytes(device, local_world=local_world_size()), Rates.measure(device)))
    budget, rates = measures
    decision = solve_recipe(
        spec,
        recipe,
        budget=budget,
        rates=rates,
        cost=cost,
        device_name=name,
        activation_scale=activation_scale,
        flags=False,  # the advice is read beside the script's own settings, not ljperf's flags
    )
    return decision, measures


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def log(line: str, *, rank_local: bool = False) -> None:
    """Print ``line`` on rank 0; a ``rank_local`` line (what this rank alone did) on every rank, after its rank."""
    if _is_main():
        print(f"{PREFIX} {line}", file=sys.stderr, flush=True)
    elif rank_local:
        print(f"{PREFIX} rank {os.environ['RANK']}: {line}", file=sys.stderr, flush=True)


def _guarded(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:
        warn(f"ljperf: CHECKPOINT_OPTIMIZATION left training unchanged: {exc}")


def warn(message: str) -> None:
    """Warn at the script's own line: the first caller outside ljperf, installed packages and the standard
    library (the hook runs under torch's module call and ``dynamo.disable``, whose lines a warning showed)."""
    import sysconfig

    paths = sysconfig.get_paths()
    library = (os.path.dirname(os.path.dirname(__file__)), paths["stdlib"], paths["purelib"], paths["platlib"], "<")
    frame, level = sys._getframe(1), 2
    while frame is not None and (
        frame.f_code.co_filename.startswith(library) or f"{os.sep}site-packages{os.sep}" in frame.f_code.co_filename
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level if frame is not None else 2)
