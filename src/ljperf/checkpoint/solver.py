"""The fastest recompute plan that fits a memory budget.

Run: ``ljperf benchmark --model torch/llama-tiny --recompute auto --memory-budget 60MiB`` or
``ljperf plan --model deepspeed/llama3.1-70b --gpus 64 --gpu-memory 80GiB --recompute auto``.

Plans are ordered ``full… selective… none…`` from the first layer: backward reaches the first layers last,
when the later layers' activations are already freed, so recomputing them adds least to the peak. A plan is
then two numbers (layers full, layers selective); every pair is ranked by its recompute time and the memory
forecast (``ljperf.forecast``) of each, cheapest first, decides the first that fits. Recompute time per layer
comes from one layer traced on fake tensors at the run's shape: full repeats the layer's FLOPs and its
memory-bound ops, selective only the memory-bound ops (``apply.SAVE_OPS`` outputs are kept).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ljperf import hardware, models
from ljperf.cache import cached
from ljperf.checkpoint import Plan, fixed_plan, parse_recompute, summary
from ljperf.checkpoint.apply import GROUPED_MM_OPS, saves
from ljperf.errors import UsageError
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.units import format_bytes, format_part, parse_memory

if TYPE_CHECKING:
    from torch._ops import OpOverload

    from ljperf.runtime import RunContext

T = TypeVar("T")

BUDGET_ENV = "LJPERF_MEMORY_BUDGET"
GPU_MARGIN = 0.10
"""Share of a GPU's memory the default budget leaves free (CUDA context, NCCL buffers, fragmentation)."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The chosen plan and why."""

    plan: Plan
    """One mode per layer."""
    budget_bytes: int | None = None
    """The memory budget per device (None: a fixed plan, nothing solved)."""
    forecast_bytes: int | None = None
    """Forecast peak of the plan (device bytes)."""
    fits: bool | None = None
    """Whether the plan's forecast is within the budget (False: even full recompute does not fit)."""
    recompute_s: float = 0.0
    """Estimated recompute seconds per micro-step."""
    recompute_flops_per_token: float = 0.0
    """Forward FLOPs per token that recompute repeats (for HFU)."""
    advice: list[str] = field(default_factory=list)
    """What would fit when nothing does, or why checkpointing cannot help."""
    rates: Rates | None = None
    """The device rates the plans were ranked with (the closed loop re-plans with them, not new ones)."""
    cost: LayerCost | None = None
    """The per-layer recompute cost they were ranked with."""

    def line(self) -> str:
        """``recomputing 12/32 layers (selective 4, full 8): forecast 71.2 of 72.0 GiB``."""
        if self.budget_bytes is None or self.forecast_bytes is None:
            return f"recomputing {summary(self.plan)}"
        text = f"recomputing {summary(self.plan)}: forecast {format_part(self.forecast_bytes, self.budget_bytes)}"
        return text if self.fits else f"{text} (does not fit: {'; '.join(self.advice)})"

    def record(self) -> dict:
        return {
            "plan": list(self.plan),
            "summary": summary(self.plan),
            "forecast_peak_bytes": self.forecast_bytes,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "recompute_s_estimate": self.recompute_s,
            "recompute_flops_per_token": self.recompute_flops_per_token,
            "advice": self.advice,
        }


# --- budget ---------------------------------------------------------------------------------------------------
def budget_bytes(
    device: torch.device, *, given: str | None = None, local_world: int = 1, memory: int | None = None
) -> int:
    """The budget: ``given``, else ``$LJPERF_MEMORY_BUDGET``, else the GPU's memory (``memory``, or this
    machine's) minus ``GPU_MARGIN``, else (CPU) ``memory`` or the available RAM shared by the node's
    ``local_world`` processes, less what each holds beyond its tensors (``hardware.ram_share``)."""
    text = given or os.environ.get(BUDGET_ENV)
    if text:
        return parse_memory(text, what="memory budget" if given else f"${BUDGET_ENV}")
    if device.type == "cuda":
        return int((memory or torch.cuda.get_device_properties(device).total_memory) * (1 - GPU_MARGIN))
    if memory:
        return memory
    if (ram := hardware.available_ram()) is None:
        raise UsageError(f"cannot read the available RAM: set {BUDGET_ENV}, e.g. {BUDGET_ENV}=16GiB")
    return hardware.ram_share(ram, processes=local_world)


# --- recompute cost -----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Rates:
    """What the device sustains: matmul FLOP/s and memory-bound bytes/s."""

    flops_per_s: float
    bytes_per_s: float

    @classmethod
    def measure(cls, device: torch.device) -> Rates:
        """A short matmul and a decoder layer's kind of pointwise ops on ``device`` (tens of milliseconds)."""
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        n = 4096 if device.type == "cuda" else 512
        # Its own generator: drawing from the global one would change what a model's dropout draws next.
        rng = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=rng)
        x = torch.randn(2**22 // 128, 128, device=device, generator=rng)
        mm = _best_time(lambda: a @ a, device)
        pointwise = _best_time(lambda: _norm_silu(x), device)
        return cls(
            flops_per_s=2 * n**3 / mm, bytes_per_s=_NORM_SILU_WRITES * 2 * x.numel() * x.element_size() / pointwise
        )

    @classmethod
    def datasheet(cls, device_name: str) -> Rates | None:
        """Peak dense BF16 FLOP/s and memory bandwidth of a known GPU (``ljperf.hardware``), else None."""
        from ljperf.hardware import peak_memory_tbps, peak_tflops

        tflops, tbps = peak_tflops(device_name), peak_memory_tbps(device_name)
        if tflops is None or tbps is None:
            return None
        return cls(flops_per_s=tflops * 1e12, bytes_per_s=tbps * 1e12)


def _norm_silu(x: torch.Tensor) -> torch.Tensor:
    # RMSNorm, SiLU gate and residual: what selective recompute repeats. ``x + x`` alone ran 4× faster than a
    # llama layer's pointwise ops on CPU (transcendentals, reductions), and ranked selective far too cheap.
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return torch.nn.functional.silu(h) * h + x


_NORM_SILU_WRITES = 5 + 3 / 128
"""Tensors of x's size that ``_norm_silu`` writes (pow, norm, silu, mul, add; mean, +eps, rsqrt per row); like
``layer_cost``, each is counted written once and read once."""

REFERENCE_GPU = "H100"
"""Whose datasheet rates rank plans for a GPU that is neither known by name nor here to measure."""


def _best_time(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        hardware.synchronize(device)
        start = time.perf_counter()
        fn()
        hardware.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One decoder layer's forward at the run's shape, split the way selective recompute splits it."""

    tokens: int
    """Tokens of the micro-batch traced (micro batch × sequence length)."""
    saved_flops: float
    """FLOPs of the ops whose outputs selective recompute keeps (matmuls, attention)."""
    pointwise_bytes: float
    """Bytes the other (memory-bound) ops write and read."""

    def seconds(self, mode: str, rates: Rates) -> float:
        pointwise = self.pointwise_bytes / rates.bytes_per_s
        return {"none": 0.0, "selective": pointwise, "full": self.saved_flops / rates.flops_per_s + pointwise}[mode]


def layer_cost(spec: models.ModelSpec, *, micro_batch: int, seq_len: int, attn: str) -> LayerCost:
    """``LayerCost`` of a decoder layer of ``spec`` of the most frequent kind (DeepSeek-V3's first three are
    dense, the other 58 mixtures of experts), traced on fake tensors; cached on disk per architecture, layer,
    attention and shape."""
    from ljperf.forecast.timeline import block_params
    from ljperf.forecast.trace import architecture_key, cache_dir, reference_kind

    kinds = block_params(spec).layer_kinds
    index = 0 if len(set(kinds)) == 1 else kinds.index(reference_kind(kinds))
    key = architecture_key(spec, "layer cost", f"layer {index}", attn, f"{micro_batch}x{seq_len}")
    return cached(
        cache_dir() / f"{spec.architecture}-cost-{key}.json",
        load=lambda data: LayerCost(**data),
        make=lambda: _traced_layer_cost(spec, index, micro_batch=micro_batch, seq_len=seq_len, attn=attn),
        dump=asdict,
    )


def _traced_layer_cost(spec: models.ModelSpec, index: int, *, micro_batch: int, seq_len: int, attn: str) -> LayerCost:
    """Trace decoder layer ``index`` of ``spec`` (0: a one-layer copy's own) on fake tensors and split its
    forward ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    from ljperf.forecast.trace import fake_model, real_code_paths

    totals = {"flops": 0.0, "bytes": 0.0}
    inside = [False]

    class Census(TorchDispatchMode):
        def __torch_dispatch__(
            self,
            func: OpOverload,
            types: Sequence[type],
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not inside[0]:
                return out
            packet = func.overloadpacket
            if saves(func):
                if packet in flop_registry:
                    totals["flops"] += flop_registry[packet](*args, **kwargs, out_val=out)
                elif func.name() in GROUPED_MM_OPS:
                    totals["flops"] += 2 * out.numel() * args[0].shape[-1]
                else:  # an attention kernel torch's counter does not know (CPU flash): q·kᵀ and p·v
                    q, k = args[0], args[1]
                    totals["flops"] += 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
            else:
                written = sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
                totals["bytes"] += 2 * written  # written once, read once by the next op
            return out

    fake_mode = FakeTensorMode()
    if index == 0:
        model = fake_model(models.with_layers(spec, 1), attn=attn, fake_mode=fake_mode)
    else:  # a copy of the full model's layer: no config of one layer builds it
        model = fake_model(spec, attn=attn, fake_mode=fake_mode, pick=(index,))
    layer = models.decoder_layers(model)[0]
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    # real_code_paths: fp32 experts run transformers' fallback op (torch's fake grouped_mm refuses fp32)
    with fake_mode, Census(), torch.no_grad(), real_code_paths():
        model(input_ids=torch.zeros(micro_batch, seq_len, dtype=torch.long), use_cache=False)
    return LayerCost(tokens=micro_batch * seq_len, saved_flops=totals["flops"], pointwise_bytes=totals["bytes"])


# --- the solver -----------------------------------------------------------------------------------------------
PeakFn = Callable[[Plan], tuple[int, str]]
"""A plan → (forecast peak device bytes, the phase that sets it)."""


def ordered_plan(layers: int, full: int, selective: int) -> Plan:
    return ("full",) * full + ("selective",) * selective + ("none",) * (layers - full - selective)


def solve(
    *, layers: int, budget: int, peak: PeakFn, cost: LayerCost, rates: Rates, advise: Callable[[], list[str]]
) -> Decision:
    """The cheapest ``full… selective… none…`` plan whose forecast fits ``budget``.

    Recomputing more never raises the peak, so with ``f`` layers full the fewest selective layers that fit,
    ``s(f)``, falls by at least one per extra full layer (one selective layer turned full still fits). The
    search walks that staircase from the first ``f`` where anything fits, and stops once ``f`` full layers
    alone cost more than the best plan: about ``L`` forecasts instead of ``L²/2``. When nothing fits, the plan
    is the cheapest that reaches full recompute's peak, the lowest there is (where the optimizer step sets it,
    less than every layer); none when recompute would save under 2% of the peak.
    """
    memo: dict[tuple[int, int], tuple[int, str]] = {}

    def forecast_of(f: int, s: int) -> tuple[int, str]:
        if (f, s) not in memo:
            memo[f, s] = peak(ordered_plan(layers, f, s))
        return memo[f, s]

    full_s, sel_s = cost.seconds("full", rates), cost.seconds("selective", rates)

    def cheapest(limit: int) -> tuple[int, int]:
        """(full, selective) of the cheapest plan within ``limit``, given that full recompute is."""

        def fits(f: int, s: int) -> bool:
            return forecast_of(f, s)[0] <= limit

        if fits(0, 0):
            return 0, 0
        lo, hi = -1, layers  # the first f with every layer recomputed (f full, the rest selective) that fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid, layers - mid) else (mid, hi)
        best: tuple[float, int, int, int] | None = None  # (seconds, layers recomputed, f, s)
        s = layers - hi
        for f in range(hi, layers + 1):
            if best is not None and f * full_s > best[0]:
                break
            s = min(s, layers - f)
            while s > 0 and fits(f, s - 1):
                s -= 1
            candidate = (f * full_s + s * sel_s, f + s, f, s)
            best = min(best, candidate) if best is not None else candidate
            if s == 0:
                break
            s -= 1
        return best[2], best[3]

    lowest, phase = forecast_of(layers, 0)
    if lowest <= budget:
        f, s = cheapest(budget)
        return _decision(
            ordered_plan(layers, f, s), budget=budget, bytes_=forecast_of(f, s)[0], cost=cost, rates=rates, fits=True
        )
    none_bytes, _ = forecast_of(0, 0)
    advice = advise()
    useless = none_bytes - lowest < 0.02 * none_bytes
    if phase.startswith("optimizer"):
        advice.insert(0, "the optimizer step, not activations, sets the peak: checkpointing cannot help")
    elif useless:
        advice.insert(0, f"activations are under 2% of the peak ({phase}): checkpointing cannot help")
    f, s = (0, 0) if useless else cheapest(lowest)
    return _decision(
        ordered_plan(layers, f, s),
        budget=budget,
        bytes_=forecast_of(f, s)[0],
        cost=cost,
        rates=rates,
        fits=False,
        advice=advice,
    )


def _decision(
    plan: Plan, *, budget: int | None, bytes_: int | None, cost: LayerCost, rates: Rates, **kw: Any
) -> Decision:
    return Decision(
        plan=plan,
        budget_bytes=budget,
        forecast_bytes=bytes_,
        recompute_s=sum(cost.seconds(m, rates) for m in plan),
        recompute_flops_per_token=plan.count("full") * cost.saved_flops / cost.tokens,
        rates=rates,
        cost=cost,
        **kw,
    )


# --- from a recipe ---------------------------------------------------------------------------------------------
def solve_recipe(
    spec: models.ModelSpec,
    recipe: Recipe,
    *,
    budget: int,
    rates: Rates,
    cost: LayerCost | None = None,
    device_name: str | None = None,
    activation_scale: float = 1.0,
    flags: bool = True,
) -> Decision:
    """The fastest plan for ``recipe`` (an ``ljperf.forecast.Recipe``) under ``budget`` bytes per device;
    ``device_name`` picks the forecast's calibrated overheads, ``activation_scale`` corrects the forecast's
    activations (the closed loop's measured ratio); ``flags``: advice in ljperf's flags, else in words."""
    from ljperf.forecast import forecast

    def peak(plan: Plan, r: Recipe = recipe) -> tuple[int, str]:
        result = forecast(spec, r.with_(recompute=plan), device_name=device_name)
        return result.device_bytes + round((activation_scale - 1) * activation_bytes(result)), result.phase

    if cost is None:
        cost = layer_cost(spec, micro_batch=recipe.micro_batch, seq_len=recipe.seq_len, attn=recipe.attn_implementation)
    full = ordered_plan(spec.layers, spec.layers, 0)
    return solve(
        layers=spec.layers,
        budget=budget,
        peak=peak,
        cost=cost,
        rates=rates,
        advise=lambda: advice(recipe, budget, lambda r: peak(full, r)[0], flags=flags),
    )


def solve_for_plan(
    spec: models.ModelSpec, recipe: Recipe, *, memory: int, device_name: str | None, given: str | None = None
) -> tuple[Decision, str]:
    """``ljperf plan --recompute auto``: the decision for ``recipe`` on a device of ``memory`` bytes (budget as
    ``budget_bytes``), and where the recompute rates came from. Nothing runs on a GPU: a GPU is ranked by its
    datasheet (only the ratio of FLOP/s to bandwidth matters for the choice)."""
    device = torch.device(recipe.device)
    budget = budget_bytes(device, given=given, memory=memory)
    if recipe.device == "cpu":
        rates, source = Rates.measure(device), "measured on this CPU"
    else:
        name = device_name or REFERENCE_GPU
        rates = Rates.datasheet(name)
        source = f"{name} datasheet"
        if rates is None:
            rates, source = Rates.datasheet(REFERENCE_GPU), f"{REFERENCE_GPU} datasheet ({name} is not in the table)"
        elif device_name is None:
            source += " (give --gpu NAME for another GPU's)"
    return solve_recipe(spec, recipe, budget=budget, rates=rates, device_name=device_name), source


def advice(recipe: Recipe, budget: int, full_peak: Callable[[Recipe], int], *, flags: bool = True) -> list[str]:
    """What would fit with full recompute, the least change of each kind (the largest micro batch, the fewest
    ranks), or a line saying none does; ``flags``: in ``ljperf``'s flags, else in words (a user's script)."""
    fitting, tried = [], []
    for kind in alternatives(recipe, flags=flags):
        first = next((text for text, r in kind if full_peak(r) <= budget), None)
        if first is not None:
            fitting.append(first)
        else:
            tried.append(kind[-1][0])
    if fitting:
        return [f"would fit with {text}" for text in fitting]
    if not tried:
        return ["only a larger memory budget would fit"]
    *most, last = tried
    return [f"full recompute does not fit with {', '.join(most) + ' or ' if most else ''}{last} either"]


def alternatives(recipe: Recipe, *, flags: bool = True) -> list[list[tuple[str, Recipe]]]:
    """Changes that cut per-device memory, each with full recompute, in the order a user would try them: kinds
    of change, each from the least change to the most."""
    out = []
    batch = "--micro-batch" if flags else "micro batch"
    if recipe.micro_batch > 1:
        b = recipe.micro_batch  # every smaller size (forecasts are cheap), else the halvings
        sizes = range(b - 1, 0, -1) if b <= 64 else sorted({b // 2**k for k in range(1, 32)} - {0}, reverse=True)
        out.append([(f"{batch} {n}", recipe.with_(micro_batch=n)) for n in sizes])
    if recipe.engine == "deepspeed" and recipe.zero_stage < 3:
        out.append([("ZeRO stage 3", recipe.with_(zero_stage=3))])
    ranks = "GPUs" if recipe.device == "cuda" else "processes"
    fsdp = "FSDP2 (engine fsdp)" if flags else "FSDP2"
    if recipe.engine == "torch" and recipe.world > 1:
        out.append([(fsdp, recipe.with_(engine="fsdp"))])
    elif recipe.engine == "torch":  # one device: only sharding over more of them lowers the model states
        out.append([(f"{fsdp} on {w} {ranks}", recipe.with_(engine="fsdp", world=w)) for w in (2, 4, 8)])
    if recipe.engine != "torch":
        out.append([(f"{recipe.world * f} {ranks}", recipe.with_(world=recipe.world * f)) for f in (2, 4)])
    return out


def shared_from_rank0(value: T) -> T:
    """``value`` as rank 0 has it, on every rank of the default process group (as is without one): plans made
    from measured rates or free memory must agree across ranks, or sharded engines would diverge."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def max_over_ranks(values: list[int], device: torch.device) -> list[int]:
    """Each of ``values``' largest value on any rank of the default process group (as is without one); the
    tensor lives on ``device``, which must suit the group's backend (CUDA for NCCL)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    largest = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.tolist()


# --- for a benchmark run ----------------------------------------------------------------------------------------
def decide_for_run(run: RunContext) -> Decision | None:
    """The plan of ``run.optim.recompute`` (a ``RunContext``): None for ``none``, solved for ``auto``."""
    value = parse_recompute(run.optim.recompute)
    if value == "none":
        return None
    train, spec = run.train, run.model
    attn = spec.attention(train.attn_implementation)
    cost = layer_cost(spec, micro_batch=train.micro_batch, seq_len=train.seq_len, attn=attn)
    rates = Rates.measure(run.device.torch_device)
    if value != "auto":
        plan = fixed_plan(value, spec.layers)
        return _decision(plan, budget=None, bytes_=None, cost=cost, rates=rates)
    from ljperf.runtime import local_world_size

    local_world = local_world_size(run.launch.nproc_per_node)
    budget = budget_bytes(run.device.torch_device, given=run.optim.memory_budget, local_world=local_world)
    return solve_recipe(
        spec, Recipe.from_run(run), budget=budget, rates=rates, cost=cost, device_name=run.device.calibration_name
    )


def prepare_run(run: RunContext) -> Decision | None:
    """Resolve ``--recompute`` for ``run`` before the engine is built: ``run.optim.recompute`` becomes the
    concrete per-layer plan, rank 0 prints the plan's line; a plan that cannot fit is a usage error (exit 2)."""
    import dataclasses

    decision = shared_from_rank0(decide_for_run(run))
    if decision is None:
        return None
    if decision.fits is False:
        raise UsageError(decision.line())
    run.optim = dataclasses.replace(run.optim, recompute=",".join(decision.plan))
    if run.is_main:
        print(decision.line(), flush=True)
    return decision


# --- the closed loop -------------------------------------------------------------------------------------------
REPLAN_BELOW = 0.85
"""A measured peak under this share of the forecast re-plans (the forecast was pessimistic: recompute less)."""


def activation_bytes(result: Forecast) -> int:
    """The part of a forecast's peak that scales with the activation coefficient."""
    return result.breakdown.get("activations", 0) + result.breakdown.get("logits_and_loss", 0)


def corrected_scale(
    *, measured: int, forecast: int, activations: int, budget: int, scale: float = 1.0, below: float = REPLAN_BELOW
) -> float | None:
    """The activation coefficient after a measured steady-state step, or None when the plan stands.

    All bytes are allocated bytes (``budget``: the budget less the forecast's reserve and context). Re-plan when
    the measured peak is over the budget and the forecast, or under ``below`` × the forecast; the whole miss is
    put on the activations (model states are counted exactly), so the new coefficient is
    ``scale × (activations + measured − forecast) / activations``, at least a tenth of ``scale``. A plan
    forecast over the budget (nothing fits) and measured as forecast stands: the forecast did not miss.
    """
    if activations <= 0 or below * forecast <= measured <= max(budget, forecast):
        return None
    return scale * max(activations + measured - forecast, activations / 10) / activations


def judge_plan(
    spec: models.ModelSpec, recipe: Recipe, decision: Decision, *, measured: int, device_name: str
) -> tuple[float | None, int]:
    """The closed loop's verdict on the running ``decision`` (solved with a budget) after a measured steady-state
    step at ``recipe``'s shape: (the corrected activation coefficient, None when the plan stands; the plan's
    forecast peak allocated bytes)."""
    from ljperf.forecast import forecast

    first = forecast(spec, recipe.with_(recompute=decision.plan), device_name=device_name)
    scale = corrected_scale(
        measured=measured,
        forecast=first.peak_allocated_bytes,
        activations=activation_bytes(first),
        budget=allocated_budget(decision.budget_bytes, first),
    )
    return scale, first.peak_allocated_bytes


def allocated_budget(budget: int, fc: Forecast) -> int:
    """The allocated bytes a device-memory ``budget`` leaves the plan of ``fc``: less its forecast reserve and
    context (a measured allocated peak is compared with this; on CPU the two are one)."""
    return budget - (fc.device_bytes - fc.peak_allocated_bytes)


def loop_line(*, measured: int, forecast: int, scale: float | None) -> str:
    """``closed loop: measured … vs forecast …`` and the verdict; a re-plan's own line follows the ``; ``."""
    head = f"closed loop: measured {format_bytes(measured)} vs forecast {format_bytes(forecast)}"
    if scale is None:
        return f"{head}; the plan stands"
    why = "above the forecast" if measured > forecast else f"under {REPLAN_BELOW:.0%} of the forecast"
    return f"{head} ({why}); activations × {scale:.3f}; "


def close_the_loop(
    run: RunContext, model: torch.nn.Module, decision: Decision, *, measured: int
) -> tuple[Decision, dict] | None:
    """After the first steady-state step: correct the activation coefficient from ``measured`` (this rank's
    peak allocated bytes of that step; the largest of any rank is used, so every rank takes the same branch),
    re-plan once and apply it to ``model`` (rank 0's plan on every rank). Returns the plan now running and what
    ``results.recompute.closed_loop`` records; None when there is no solved plan."""
    from ljperf.checkpoint.apply import apply_plan
    from ljperf.memory import reset_cuda_peak

    device = run.device.torch_device
    if decision.budget_bytes is None:
        return None
    (measured,) = max_over_ranks([measured], device)
    scale, first_peak = judge_plan(
        run.model, Recipe.from_run(run), decision, measured=measured, device_name=run.device.calibration_name
    )
    loop = {
        "first": {"plan": list(decision.plan), "forecast_peak_bytes": first_peak},
        "first_measured_peak_bytes": measured,
        "activation_scale": scale,
        "replanned": scale is not None,
    }
    if scale is not None:
        again = solve_recipe(
            run.model,
            Recipe.from_run(run),
            budget=decision.budget_bytes,
            rates=decision.rates,
            cost=decision.cost,
            device_name=run.device.calibration_name,
            activation_scale=scale,
        )
        again = shared_from_rank0(again)
        apply_plan(model, again.plan)
        reset_cuda_peak(device)  # the run's peak is now the second plan's
        loop["second"] = {"plan": list(again.plan), "forecast_peak_bytes": again.forecast_bytes, "fits": again.fits}
        decision = again
        if run.is_main:
            print(loop_line(measured=measured, forecast=first_peak, scale=scale) + again.line(), flush=True)
    return decision, shared_from_rank0(loop)
