"""The fastest recompute plan that fits a memory budget.

Run: ``ljperf benchmark --model torch/llama-tiny --recompute auto --memory-budget 60MiB`` or
``ljperf plan --model deepspeed/llama3.1-70b --gpus 64 --gpu-memory 80GiB --recompute auto``.

Plans are ordered ``full… selective… none…`` from the first layer: backward reaches the first layers last,
when the later layers' activations are already freed, so recomputing them adds least to the peak. A plan is
then two numbers (layers full, layers selective); every pair is ranked by its recompute time and the memory
forecast (``ljperf.forecast``) of each, cheapest first, decides the first that fits. Recompute time per layer
comes from one layer traced on fake tensors at the run's shape: full repeats the layer's FLOPs and its
memory-bound ops, selective only the memory-bound ops (``checkpoint.policies.SAVE_OPS`` outputs are kept). The
decision's ``policy`` (a ``checkpoint.policies.PerLayerRecompute``) is what ``--recompute auto`` resolves to.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ljperf.checkpoint.policies import PerLayerRecompute
from ljperf.core.plans import Plan, summary
from ljperf.core.units import format_bytes, format_part
from ljperf.forecast.advice import dominant_term
from ljperf.forecast.api import forecast
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.models.spec import ModelSpec
from ljperf.recompute.budget import budget_bytes
from ljperf.recompute.cost import REFERENCE_GPU, Rates, RecomputeCost, layer_cost


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
    none_bytes: int | None = None
    full_bytes: int | None = None
    """Forecast peaks (device bytes) with no layer and with every layer recomputed (None: a fixed plan)."""
    recompute_s: float = 0.0
    """Estimated recompute seconds per micro-step."""
    recompute_flops_per_token: float = 0.0
    """Forward FLOPs per token that recompute repeats (for HFU)."""
    advice: list[str] = field(default_factory=list)
    """What would fit when nothing does, or why checkpointing cannot help."""
    rates: Rates | None = None
    """The device rates the plans were ranked with (the closed loop re-plans with them, not new ones)."""
    cost: RecomputeCost | None = None
    """The per-layer recompute cost they were ranked with."""

    @property
    def policy(self) -> PerLayerRecompute:
        """The plan as the policy that applies it to a model."""
        return PerLayerRecompute(self.plan)

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
            "forecast_none_bytes": self.none_bytes,
            "forecast_full_bytes": self.full_bytes,
            "recompute_s_estimate": self.recompute_s,
            "recompute_flops_per_token": self.recompute_flops_per_token,
            "advice": self.advice,
        }


PeakFn = Callable[[Plan], tuple[int, str]]
"""A plan → (forecast peak device bytes, the phase that sets it)."""


TIE_SHARE = 0.01
"""Plans whose recompute estimates differ by under this share of a step's estimate (three forwards of every
layer: forward and backward, no recompute) are near-ties: a difference that small is within the cost model's
error."""


def ordered_plan(layers: int, full: int, selective: int) -> Plan:
    return ("full",) * full + ("selective",) * selective + ("none",) * (layers - full - selective)


def solve(
    *, layers: int, budget: int, peak: PeakFn, cost: RecomputeCost, rates: Rates, advise: Callable[[], list[str]]
) -> Decision:
    """The cheapest ``full… selective… none…`` plan whose forecast fits ``budget``.

    Recomputing more never raises the peak, so with ``f`` layers full the fewest selective layers that fit,
    ``s(f)``, falls by at least one per extra full layer (one selective layer turned full still fits). The
    search walks that staircase from the first ``f`` where anything fits, and stops once ``f`` full layers
    alone cost more than the best plan: about ``L`` forecasts instead of ``L²/2``. Plans within ``TIE_SHARE``
    of a step of the fastest are near-ties, decided by a fixed order, not by noise in ``rates``: the fewest
    layers recomputed (each has costs the estimate leaves out: its checkpoint's hooks, selective's op policy),
    then the fewest full. When nothing fits, the plan is the cheapest that reaches full recompute's peak, the
    lowest there is (where the optimizer step sets it, less than every layer); none when recompute would save
    under 2% of the peak.
    """
    memo: dict[tuple[int, int], tuple[int, str]] = {}

    def forecast_of(f: int, s: int) -> tuple[int, str]:
        if (f, s) not in memo:
            memo[f, s] = peak(ordered_plan(layers, f, s))
        return memo[f, s]

    full_s, sel_s = cost.seconds("full", rates), cost.seconds("selective", rates)
    band = TIE_SHARE * 3 * layers * full_s

    def cheapest(limit: int) -> tuple[int, int]:
        """(full, selective) of the cheapest plan within ``limit``, given that full recompute is; of those within
        ``band`` of it, the one of the fewest layers recomputed, then of the fewest full."""

        def fits(f: int, s: int) -> bool:
            return forecast_of(f, s)[0] <= limit

        if fits(0, 0):
            return 0, 0
        lo, hi = -1, layers  # the first f with every layer recomputed (f full, the rest selective) that fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid, layers - mid) else (mid, hi)
        found: list[tuple[float, int, int]] = []  # (seconds, f, s): the fewest selective layers for each f
        s = layers - hi
        for f in range(hi, layers + 1):
            if found and f * full_s > min(found)[0] + band:
                break
            s = min(s, layers - f)
            while s > 0 and fits(f, s - 1):
                s -= 1
            found.append((f * full_s + s * sel_s, f, s))
            if s == 0:
                break
            s -= 1
        fastest = min(found)[0]
        return min((f + s, f, s) for seconds, f, s in found if seconds <= fastest + band)[1:]

    lowest, phase = forecast_of(layers, 0)

    def decided(f: int, s: int, **kw: Any) -> Decision:
        plan, peak_bytes = ordered_plan(layers, f, s), forecast_of(f, s)[0]
        return decision_of(
            plan, budget=budget, bytes_=peak_bytes, cost=cost, rates=rates, none_bytes=forecast_of(0, 0)[0],
            full_bytes=lowest, **kw,
        )  # fmt: skip

    if lowest <= budget:
        return decided(*cheapest(budget), fits=True)
    none_bytes, _ = forecast_of(0, 0)
    advice = advise()
    useless = none_bytes - lowest < 0.02 * none_bytes
    if phase.startswith("optimizer"):
        advice.insert(0, "the optimizer step, not activations, sets the peak: checkpointing cannot help")
    elif useless:
        advice.insert(0, f"activations are under 2% of the peak ({phase}): checkpointing cannot help")
    return decided(*((0, 0) if useless else cheapest(lowest)), fits=False, advice=advice)


def decision_of(
    plan: Plan, *, budget: int | None, bytes_: int | None, cost: RecomputeCost, rates: Rates, **kw: Any
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
    spec: ModelSpec,
    recipe: Recipe,
    *,
    budget: int,
    rates: Rates,
    cost: RecomputeCost | None = None,
    device_name: str | None = None,
    activation_scale: float = 1.0,
    flags: bool = True,
) -> Decision:
    """The fastest plan for ``recipe`` (an ``ljperf.forecast.Recipe``) under ``budget`` bytes per device;
    ``device_name`` picks the forecast's calibrated overheads, ``activation_scale`` corrects the forecast's
    activations (the closed loop's measured ratio); ``flags``: advice in ljperf's flags, else in words."""

    def peak(plan: Plan, r: Recipe = recipe) -> tuple[int, str]:
        result = forecast(spec, r.with_(recompute=plan), device_name=device_name)
        return result.device_bytes + round((activation_scale - 1) * activation_bytes(result)), result.phase

    if cost is None:
        cost = layer_cost(spec, micro_batch=recipe.micro_batch, seq_len=recipe.seq_len, attn=recipe.attn_implementation)
    full = ordered_plan(spec.layers, spec.layers, 0)

    def advise() -> list[str]:
        """The term that dominates full recompute's peak, if one does, then what would fit."""
        at_full = forecast(spec, recipe.with_(recompute=full), device_name=device_name)
        dominant = dominant_term(spec, recipe.with_(recompute=full), at_full, device_name=device_name, flags=flags)
        return [*([dominant] if dominant else []), *advice(recipe, budget, lambda r: peak(full, r)[0], flags=flags)]

    return solve(layers=spec.layers, budget=budget, peak=peak, cost=cost, rates=rates, advise=advise)


def solve_for_plan(
    spec: ModelSpec, recipe: Recipe, *, memory: int, device_name: str | None, given: str | None = None
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
            rates, source = Rates.reference(), f"{REFERENCE_GPU} datasheet ({name} is not in the table)"
        elif device_name is None:  # --gpu-memory alone: no GPU named, none here
            source += f" rates; the device: the given {format_bytes(memory)} (--gpu-memory), uncalibrated overheads"
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


def activation_bytes(result: Forecast) -> int:
    """The part of a forecast's peak that scales with the activation coefficient."""
    return result.breakdown.get("activations", 0) + result.breakdown.get("logits_and_loss", 0)
