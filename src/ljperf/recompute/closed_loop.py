"""The closed loop: after the first steady-state step, the measured peak corrects the forecast's activations
and the plan is solved again once when the forecast missed.

Run: any ``ljperf benchmark --recompute auto`` with ``--warmup 2`` or more (3 on CPU and when compiled).
"""

from __future__ import annotations

from typing import Any

import torch

from ljperf.core.console import say
from ljperf.core.units import format_bytes
from ljperf.distributed.collectives import max_over_ranks, shared_from_rank0
from ljperf.distributed.memory import reset_cuda_peak
from ljperf.forecast.api import forecast
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.models.spec import ModelSpec
from ljperf.recompute.solver import Decision, activation_bytes, solve_recipe
from ljperf.run.context import RunContext

REPLAN_BELOW = 0.85
"""A measured peak under this share of the forecast re-plans (the forecast was pessimistic: recompute less)."""


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
    spec: ModelSpec, recipe: Recipe, decision: Decision, *, measured: int, device_name: str
) -> tuple[float | None, int]:
    """The closed loop's verdict on the running ``decision`` (solved with a budget) after a measured steady-state
    step at ``recipe``'s shape: (the corrected activation coefficient, None when the plan stands; the plan's
    forecast peak allocated bytes)."""
    if decision.budget_bytes is None:
        raise ValueError("the closed loop judges a plan solved under a budget (--recompute auto): this one is fixed")
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
    device = run.device.torch_device
    budget, rates = decision.budget_bytes, decision.rates
    if budget is None or rates is None:
        return None
    (measured,) = max_over_ranks([measured], device)
    scale, first_peak = judge_plan(
        run.model, Recipe.from_run(run), decision, measured=measured, device_name=run.device.calibration_name
    )
    loop: dict[str, Any] = {
        "first": {"plan": list(decision.plan), "forecast_peak_bytes": first_peak},
        "first_measured_peak_bytes": measured,
        "activation_scale": scale,
        "replanned": scale is not None,
    }
    if scale is not None:
        again = solve_recipe(
            run.model,
            Recipe.from_run(run),
            budget=budget,
            rates=rates,
            cost=decision.cost,
            device_name=run.device.calibration_name,
            activation_scale=scale,
        )
        again = shared_from_rank0(again)
        again.policy.apply(model)
        reset_cuda_peak(device)  # the run's peak is now the second plan's
        loop["second"] = {"plan": list(again.plan), "forecast_peak_bytes": again.forecast_bytes, "fits": again.fits}
        decision = again
        if run.is_main:
            say(loop_line(measured=measured, forecast=first_peak, scale=scale) + again.line())
    return decision, shared_from_rank0(loop)
