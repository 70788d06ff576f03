"""``--recompute`` of a benchmark run resolved before its engine is built: none, a fixed plan, or ``auto``
solved under the run's budget (rank 0's plan on every rank).

Run: ``ljperf benchmark --model torch/llama-tiny --recompute auto --memory-budget 60MiB``; ``untested_auto(cfg)``
says before a CPU run that auto with no budget given will recompute nothing.
"""

from __future__ import annotations

import os

import torch

from ljperf.core.console import say
from ljperf.core.errors import UsageError
from ljperf.core.plans import BUDGET_ENV, budget_holds_all, fixed_plan, no_recompute_line, parse_recompute
from ljperf.distributed.collectives import shared_from_rank0
from ljperf.distributed.launch import local_world_size
from ljperf.forecast.api import forecast
from ljperf.forecast.recipe import Recipe
from ljperf.recompute.budget import budget_bytes
from ljperf.recompute.cost import Rates, layer_cost, run_rates
from ljperf.recompute.solver import Decision, decision_of, solve_recipe
from ljperf.run.config import RunConfig
from ljperf.run.context import RunContext


def decide_for_run(run: RunContext) -> Decision | None:
    """The plan of ``run.optim.recompute`` (a ``RunContext``): None for ``none``, solved for ``auto``."""
    value = parse_recompute(run.optim.recompute)
    if value == "none":
        return None
    spec, recipe = run.model, Recipe.from_run(run)  # the run's shape, its sequence length resolved
    micro_batch, seq_len, attn = recipe.micro_batch, recipe.seq_len, recipe.attn_implementation
    cost = layer_cost(spec, micro_batch=micro_batch, seq_len=seq_len, attn=attn)
    device, name = run.device.torch_device, run.device.calibration_name
    rates = Rates.measure(device)
    if value != "auto":
        plan = fixed_plan(value, spec.layers)
        return decision_of(plan, budget=None, bytes_=None, cost=cost, rates=rates)
    budget = budget_bytes(
        device, given=run.optim.memory_budget, local_world=local_world_size(run.launch.nproc_per_node)
    )
    none, full = (
        forecast(spec, recipe.with_(recompute=(m,) * spec.layers), device_name=name) for m in ("none", "full")
    )
    if full.device_bytes <= budget < none.device_bytes:
        # a choice to make: rank the plans by what recomputing a real layer takes here (seconds, once per shape)
        rates = run_rates(spec, cost, micro_batch=micro_batch, seq_len=seq_len, attn=attn, device=device, bf16=run.bf16)
    return solve_recipe(spec, recipe, budget=budget, rates=rates, cost=cost, device_name=name)


def prepare_run(run: RunContext) -> Decision | None:
    """Resolve ``--recompute`` for ``run`` before the engine is built: ``run.plan`` becomes the per-layer plan,
    rank 0 prints the plan's line; a plan that cannot fit is a usage error (exit 2)."""
    decision = shared_from_rank0(decide_for_run(run))
    if decision is None:
        return None
    if decision.fits is False:
        raise UsageError(decision.line())
    run.plan = decision.plan
    if run.is_main:
        say(decision.line())
        if idle := no_recompute_line(decision.record()):
            say(idle)
    return decision


def untested_auto(cfg: RunConfig) -> str | None:
    """Before a CPU run of ``cfg`` with ``--recompute auto`` and no budget given (no ``--memory-budget``, no
    ``$LJPERF_MEMORY_BUDGET``): the budget is the RAM, which holds a small run whole, so auto will recompute
    nothing. Then the line that says so, with a budget between the forecasts with no and with full recompute;
    None otherwise (``ljperf ablation`` prints it for each such variant before its runs)."""
    given = cfg.optim.memory_budget or os.environ.get(BUDGET_ENV)
    if parse_recompute(cfg.optim.recompute) != "auto" or cfg.train.device != "cpu" or given:
        return None
    launch, layers = cfg.launch, cfg.model.layers
    budget = budget_bytes(torch.device("cpu"), local_world=launch.nproc_per_node)
    recipe = Recipe.of(cfg, world=launch.nproc_per_node * launch.nnodes, device="cpu")
    none, full = (forecast(cfg.model, recipe.with_(recompute=(m,) * layers)).device_bytes for m in ("none", "full"))
    if none > budget:
        return None
    holds = budget_holds_all(budget=budget, peak=none, none=none, full=full)
    return f"recompute auto will choose no recompute: {holds}"
