"""The ``CHECKPOINT_OPTIMIZATION`` planner of one model: the recipe read from the script's Trainer, DeepSpeed engine
or FSDP2 call, the plan made at the first training forward (again for a larger batch), and the closed loop after
the second step.

Run: ``attach(model, lambda: fsdp_setup(model, {}))``; ``startup_hooks.checkpoint`` calls it when the script builds its
Trainer, DeepSpeed engine or FSDP2 root (docs/checkpoint.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import PreTrainedModel

from ljperf.checkpoint.policies import script_checkpoints
from ljperf.core.choices import Precision
from ljperf.core.errors import UsageError
from ljperf.core.hardware import calibration_name
from ljperf.distributed.collectives import max_over_ranks, shared_from_rank0
from ljperf.distributed.launch import local_world_size
from ljperf.distributed.memory import (
    LiveTensorBytes,
    cuda_peaks,
    reachable_tensors,
    reset_cuda_peak,
    training_state_tensors,
)
from ljperf.forecast.recipe import Recipe, ZeroSettings
from ljperf.models.layout import decoder_layers
from ljperf.models.spec import ModelSpec
from ljperf.recompute.budget import budget_bytes
from ljperf.recompute.closed_loop import judge_plan, loop_line
from ljperf.recompute.cost import Rates, RecomputeCost
from ljperf.recompute.solver import Decision, solve_recipe
from ljperf.startup_hooks.messages import log, warn

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.utils.hooks import RemovableHandle
    from transformers import Trainer

REPLACES = "replaces the script's gradient_checkpointing=True"
_HOOK = "_ljperf_checkpoint_hook"
"""The model attribute that holds its planner (None once the planner removed itself)."""


def trainer_setup(trainer: Trainer) -> dict[str, Any]:

    args = trainer.args
    mixed = "bf16-mixed" if args.bf16 else "fp32"
    # Loaded in bfloat16: no fp32 master (accelerate's FSDP2 upcasts under bf16 mixed precision before this runs).
    if trainer.model is None:
        raise ValueError("the Trainer has no model")
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
        setup |= {
            "engine": "deepspeed",
            "precision": mixed,  # DeepSpeed keeps fp32 master weights of a bf16 model
            # Stage 0 (DeepSpeed's data parallelism) is planned as ZeRO-1, as ``_deepspeed_setup`` does.
            "zero_stage": max(ds.config.get("zero_optimization", {}).get("stage", 0), 1),
            "zero": ZeroSettings.from_config(ds.config),
        }
    return setup


def deepspeed_setup(engine: DeepSpeedEngine) -> dict[str, Any]:

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


def fsdp_setup(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:

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
    planner = getattr(model, _HOOK, None)
    if planner is None:  # a Trainer running DeepSpeed or FSDP2 attaches once, from Trainer.__init__
        planner = _Planner(model, setup)
        setattr(model, _HOOK, planner)
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

        self.model, self.make_setup = model, setup
        self.setup: dict[str, Any] = {}  # read from the script's objects at the first training forward
        self.measures: tuple | None = None  # rank 0's (budget, rates), measured at the first plan
        self.decision: Decision | None = None
        self.shape = (0, 0)
        self.activation_scale = 1.0
        self.warned = False  # that no plan fits
        self.steps = 0  # training steps whose optimizer has stepped
        self.forwards = 0  # training forwards since the last step
        self.optimizer = None
        self.holders: list = []
        self.window: _Window | None = None
        self.forward_handle = model.register_forward_pre_hook(torch._dynamo.disable(self.pre_forward), with_kwargs=True)
        self.step_handle: RemovableHandle | None = register_optimizer_step_post_hook(self.after_step)

    def after_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Counted once per training step: ZeRO-3 steps its optimizer once per parameter sub-group.
        if self.forwards:
            self.steps, self.forwards, self.optimizer = self.steps + 1, 0, optimizer

    def pre_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:

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
            if not self.setup:
                self.setup = self.make_setup()
            shape = _largest_shape(ids) if _agreed(self.setup) else (ids.shape[0], ids.shape[1])
            self.measure(shape, ids.device)
            if shape[0] * shape[1] > self.shape[0] * self.shape[1]:
                self.plan(shape)
        except Exception as exc:
            self.remove()
            warn(f"CHECKPOINT_OPTIMIZATION left training unchanged: {exc}")

    def plan(
        self, shape: tuple[int, int], *, prefix: str = "", cost: RecomputeCost | None = None, rank_local: bool = False
    ) -> None:

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
        replaces = self.decision is None and script_checkpoints(self.model)
        decision.policy.apply(self.model)
        self.decision, self.shape = decision, shape
        line = prefix + decision.line() + (f" ({REPLACES})" if replaces else "")
        if decision.fits is False and not self.warned:  # once: re-plans for longer batches log their lines
            self.warned = True
            warn(line)
        else:
            log(line, rank_local=rank_local)

    def measure(self, shape: tuple[int, int], device: torch.device) -> None:
        """Open the window at the second step's first training forward, widen it to each forward's batch, and
        close the loop at the first forward after that step."""
        decision = self.decision
        if decision is None or self.steps == 0 or self.step_handle is None:
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
            (measured,) = max_over_ranks([measured], device)
        self.close_loop(decision, measured, self.window.shape)

    def close_loop(self, decision: Decision, measured: int, shape: tuple[int, int]) -> None:

        spec, recipe, _, name = model_recipe(self.model, micro_batch=shape[0], seq_len=shape[1], **self.setup)
        scale, first_peak = judge_plan(spec, recipe, decision, measured=measured, device_name=name)
        rank0 = shared_from_rank0(scale)
        if _agreed(self.setup):  # every rank measured the largest peak; one verdict keeps one plan
            scale = rank0
        line = loop_line(measured=measured, forecast=first_peak, scale=scale)
        own_verdict = (scale is None) != (rank0 is None)  # this rank alone re-plans, or alone keeps its plan
        if scale is None:
            log(line, rank_local=own_verdict)
            return
        self.activation_scale = scale
        self.plan(self.shape, prefix=line, cost=decision.cost, rank_local=own_verdict)

    def _state_tensors(self) -> list:
        """What lives between steps, for the CPU measurement (ZeRO-3 keeps its partitions in ``ds_tensor``)."""

        partitions = [p.ds_tensor for p in self.model.parameters() if getattr(p, "ds_tensor", None) is not None]
        held = [t for holder in self.holders for t in reachable_tensors(holder)]
        return training_state_tensors(self.model, self.optimizer) + partitions + held

    def remove(self) -> None:
        for handle in (self.forward_handle, self.step_handle):
            if handle is not None:
                handle.remove()
        if self.window is not None:
            self.window.close()
        setattr(self.model, _HOOK, None)


class _Window:
    """The peak allocated bytes from its opening: CUDA's allocator counters, or live tensors on CPU."""

    def __init__(self, device: torch.device, alive: list, *, step: int):

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

        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.peak, self.tracker = self.tracker.peak, None
        return cuda_peaks(self.device)[0] if self.device.type == "cuda" else self.peak


def _batch_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The batch's token ids (or embeddings): a tensor whose first two dimensions are (micro batch, sequence)."""

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

    micro_batch, seq_len = max_over_ranks(list(ids.shape[:2]), ids.device)
    return micro_batch, seq_len


def model_recipe(
    model: torch.nn.Module, *, micro_batch: int, seq_len: int, world: int, precision: Precision, **recipe: Any
) -> tuple[ModelSpec, Recipe, torch.device, str]:
    """The forecast's view of training this HF model at this batch shape: (spec, recipe, the torch device,
    the name its forecast overheads are calibrated under)."""

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
        device="cuda" if device.type == "cuda" else "cpu",
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
    cost: RecomputeCost | None = None,
    **setup: Any,
) -> tuple[Decision, tuple[int, Rates]]:
    """The solver's decision for this HF model at this batch shape (budget: ``LJPERF_MEMORY_BUDGET`` or device),
    and the (budget, rates) it used: rank 0's, measured on the first call and passed back in on later ones.
    ``cost``: the per-layer recompute cost at this shape when already traced (a re-plan at the same shape)."""

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
