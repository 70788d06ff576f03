"""The record of ``ljperf plan`` (``--json``) and its table: the forecast breakdown, whether it fits, the largest
micro batch, and notes on what would fit.

Run: ``print_plan(plan_record(spec, recipe, forecast(spec, recipe), memory=80 * 2**30, ...))``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.markup import escape
from rich.table import Table

from ljperf.core import deepspeed_config
from ljperf.core.console import console, titled_table
from ljperf.core.mesh import MeshShape
from ljperf.core.plans import describe
from ljperf.core.records import SCHEMA_VERSION
from ljperf.core.units import format_bytes, unit_of
from ljperf.forecast.advice import dominant_term
from ljperf.forecast.api import forecast, max_micro_batch
from ljperf.forecast.blocks import block_params
from ljperf.forecast.over_step import LABELS
from ljperf.forecast.pipeline import bubble_fraction
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.models.spec import ModelSpec
from ljperf.plan.speed import speed_lines, speed_record
from ljperf.recompute.budget import budget_source
from ljperf.recompute.solver import Decision, solve_for_plan
from ljperf.run.config import RunConfig, fixed_recompute
from ljperf.run.titles import shape_title, strategy
from ljperf.speed.rates import Cluster


def planned(
    cfg: RunConfig, *, world: int, memory: int, device_name: str | None, cluster: Cluster | None = None
) -> tuple[dict, Decision | None]:
    """The plan record of ``cfg`` on ``world`` devices of ``memory`` bytes, and the decision of ``--recompute
    auto`` (None for a fixed plan), solved under its budget; its speed on ``cluster`` (``plan.speed``)."""
    spec, device = cfg.model, cfg.train.resolved_device
    recipe = Recipe.of(cfg, world=world, device=device, recompute=fixed_recompute(cfg) or ())
    decision = rates = None
    if cfg.optim.recompute == "auto":
        budget_flag = cfg.optim.memory_budget
        decision, rates = solve_for_plan(spec, recipe, memory=memory, device_name=device_name, given=budget_flag)
        recipe = recipe.with_(recompute=decision.plan)
    result = forecast(spec, recipe, device_name=device_name)
    most = recipe.with_(recompute=("full",) * spec.layers) if decision else recipe  # the most auto can save
    budget = decision.budget_bytes if decision else None  # auto's limit: fits, headroom and the largest batch
    # a budget above the device's memory bounds the plan (the note below says it may not run), not the batch
    limit = min(budget or memory, memory)
    best = max_micro_batch(spec, most, limit, device_name=device_name)
    warnings = deepspeed_warnings(cfg, world=world)
    report = plan_record(spec, recipe, result, memory=memory, budget=budget, max_micro_batch=best, warnings=warnings)
    # what the next micro batch would need: "headroom 27 GiB; largest micro batch 1" read as a contradiction
    report["next_micro_batch_bytes"] = forecast(
        spec, most.with_(micro_batch=best + 1), device_name=device_name
    ).device_bytes
    # first: what else would fit is read in its light; auto's advice when nothing fits names it already
    dominant = dominant_term(spec, recipe, result, device_name=device_name)
    if dominant and (decision is None or decision.fits):
        report["notes"].append(dominant)
    if decision is not None:
        source = budget_source(device, given=cfg.optim.memory_budget, memory=memory)
        report["recompute"] = decision.record() | {"rates": rates, "budget_source": source}
        report["notes"] += auto_notes(decision, memory=memory)
    elif not report["fits"] and set(recipe.layer_modes(spec.layers)) != {"full"}:
        report["notes"].append(full_recompute_note(spec, recipe, memory=memory, device_name=device_name))
    report["device_name"] = device_name
    report["speed"] = speed_record(
        spec, recipe, device_name=device_name, cluster=cluster or Cluster(), threads=cfg.train.threads
    )
    return report, decision


def deepspeed_warnings(cfg: RunConfig, *, world: int) -> list[deepspeed_config.Finding]:
    """The lint's warnings of ``--deepspeed-config``, checked as the benchmark checks it (a contradiction is exit 2)."""
    if not cfg.deepspeed_user:
        return []
    batch = deepspeed_config.Settings(
        micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum, zero_stage=cfg.engine_opts.zero_stage
    )
    source = f"--deepspeed-config {cfg.engine_opts.deepspeed_config}"
    config = deepspeed_config.merge(cfg.deepspeed_user)
    return deepspeed_config.check(config, batch, world=world, bf16=cfg.train.precision == "bf16-mixed", source=source)


def auto_notes(decision: Decision, *, memory: int) -> list[str]:
    notes = ["largest micro batch counted with full recompute, the most --recompute auto saves"]
    if decision.budget_bytes is not None and decision.budget_bytes > memory:
        notes.append(
            f"the memory budget {format_bytes(decision.budget_bytes)} is more than the device's "
            f"{format_bytes(memory)}: a plan within it can still run out of memory"
        )
    return notes


def full_recompute_note(spec: ModelSpec, recipe: Recipe, *, memory: int, device_name: str | None) -> str:
    """What full recompute would do for a recipe that does not fit: fit, or what else to change."""
    at_full = forecast(spec, recipe.with_(recompute=("full",) * spec.layers), device_name=device_name)
    full = at_full.device_bytes
    if full <= memory:
        verdict = "which fits; --recompute auto recomputes the fewest layers that fit"
    else:
        shard = "a sharding engine (fsdp/, deepspeed/)" if recipe.engine == "torch" else "more --gpus"
        less = "fewer tokens per micro-step (--micro-batch, --seq-len)"
        if at_full.phase.startswith("optimizer"):  # tokens do not reach it; the AdamW kind's temporaries do
            less = "the optimizer step sets that peak: --optimizer fused (no step temporaries)"
        verdict = f"which does not fit either: {less} or {shard}"
    return f"with --recompute full: {format_bytes(full)} on the device, {verdict}"


def plan_record(
    spec: ModelSpec,
    recipe: Recipe,
    result: Forecast,
    *,
    memory: int,
    budget: int | None,
    max_micro_batch: int,
    warnings: list[deepspeed_config.Finding],
) -> dict:
    """The JSON object of ``ljperf plan --json``: what fits is measured against ``budget`` (--recompute auto's)
    when there is one, else against the device's ``memory``."""

    recipe_dict: dict[str, Any] = asdict(recipe)
    recipe_dict["recompute"] = list(recipe.layer_modes(spec.layers))
    if recipe.engine != "deepspeed":
        del recipe_dict["zero_stage"], recipe_dict["zero"]
    if recipe.engine == "fsdp":
        recipe_dict["mesh"] = recipe.mesh.record()
    params = block_params(spec).total  # from a one-layer build: no full-depth model needed
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "plan",
        "model": {"name": spec.name, "architecture": spec.architecture, "params": params},
        "recipe": recipe_dict,
        "peak_allocated_bytes": result.peak_allocated_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "context_bytes": result.context_bytes,
        "device_bytes": result.device_bytes,
        "breakdown": result.breakdown,
        "phase": result.phase,
        "source": result.source,
        "analytic_reason": result.analytic_reason,
        "gpu_memory_bytes": memory,
        "memory_budget_bytes": budget,
        "headroom_bytes": (budget or memory) - result.device_bytes,
        "fits": result.device_bytes <= (budget or memory),
        "max_micro_batch": max_micro_batch,
        "notes": result.notes,
        "warnings": [f"{f.message}; fix: {f.fix}" for f in warnings],
    } | ({"pipeline": pipeline_record(recipe, result)} if recipe.pp > 1 else {})


def pipeline_record(recipe: Recipe, result: Forecast) -> dict[str, Any]:
    """``--pp``: the schedule, the split (decoder layers per stage), each pipeline rank's peak allocated bytes (the
    highest is the plan's) and the bubble fraction (p − 1) / (V·m + p − 1)."""
    return {
        "schedule": recipe.pp_schedule,
        "microbatches": recipe.grad_accum,
        "stages_per_rank": recipe.pp_stages_per_rank,
        "split": list(result.pp_split),
        "peak_allocated_bytes_per_pp_rank": list(result.stage_peaks),
        "bubble_fraction": bubble_fraction(
            pp=recipe.pp, microbatches=recipe.grad_accum, stages_per_rank=recipe.pp_stages_per_rank
        ),
    }


def pipeline_table(pipeline: dict[str, Any]) -> Table:
    """One row per pipeline rank: its stages' decoder layers and its peak."""
    split, pp = pipeline["split"], len(pipeline["peak_allocated_bytes_per_pp_rank"])
    starts = [sum(split[:i]) for i in range(len(split))]
    table = titled_table(f"pipeline: {pipeline['schedule']}, {pipeline['microbatches']} micro-batches a step")
    for column in ("pipeline rank", "stages", "decoder layers", "peak allocated"):
        table.add_column(column, justify="left" if column == "decoder layers" else "right")
    for rank, peak in enumerate(pipeline["peak_allocated_bytes_per_pp_rank"]):
        stages = list(range(rank, len(split), pp))
        layers = ", ".join(f"{starts[s]}-{starts[s] + split[s] - 1}" if split[s] else "none" for s in stages)
        table.add_row(str(rank), ", ".join(map(str, stages)), layers, format_bytes(peak))
    return table


def print_plan(report: dict) -> None:
    recipe = report["recipe"]
    where = f"{recipe['world']} × {recipe['device']}"
    if mesh := MeshShape(**recipe.get("mesh", {})).describe():
        where += f" ({mesh})"
    how = strategy(
        recipe["engine"],
        zero_stage=recipe.get("zero_stage"),
        mesh=recipe.get("mesh", {}),
        reshard_after_forward=recipe.get("reshard_after_forward", True),
    )
    where += f" · {how}" if how else ""
    table = titled_table(shape_title(recipe["engine"], report["model"]["name"], where=where, shape=recipe))
    peak = report["peak_allocated_bytes"]
    unit, scale = unit_of(peak)  # one unit for the column, the peak's (tiny models read 0.00 in GiB)
    table.add_column("component")
    table.add_column(unit, justify="right")
    table.add_column("share", justify="right")
    for name, value in sorted(report["breakdown"].items(), key=lambda kv: -kv[1]):
        table.add_row(LABELS.get(name, name.replace("_", " ")), f"{value / scale:.2f}", f"{100 * value / peak:.1f}%")
    table.add_section()
    table.add_row("peak allocated per rank", f"{peak / scale:.2f}", "100.0%")
    console.print(table)
    lines = [f"peak at: {report['phase']} ({report['source']})"]
    if reason := report.get("analytic_reason"):
        lines.append(f"forecast by the analytic formula, not traced: {reason}")
    if pipeline := report.get("pipeline"):
        console.print(pipeline_table(pipeline))
        lines.append(
            f"pipeline bubble: {100 * pipeline['bubble_fraction']:.1f}% of the step (ranks idle filling and draining)"
        )
    if "recompute" in report:
        r = report["recompute"]
        budget = f"budget {format_bytes(r['budget_bytes'])}: {r['budget_source']}"
        lines.insert(0, f"recompute auto: {describe(r['plan'])} ({budget}; rates: {r['rates']})")
    if report["peak_reserved_bytes"] is not None:
        lines.append(
            f"reserved {format_bytes(report['peak_reserved_bytes'])} + context {format_bytes(report['context_bytes'])}"
            f" = {format_bytes(report['device_bytes'])} on the device"
        )
    verdict = "fits" if report["fits"] else "does NOT fit"
    where = format_bytes(report["gpu_memory_bytes"])
    if (budget := report["memory_budget_bytes"]) is not None:
        where = f"the budget {format_bytes(budget)} (device {where})"
    best, above = report["max_micro_batch"], format_bytes(report["next_micro_batch_bytes"])
    largest = f"{best} (micro batch {best + 1} would need {above})" if best else f"none (micro batch 1 needs {above})"
    headroom = format_bytes(report["headroom_bytes"])
    lines.append(f"{verdict} in {where}: headroom {headroom}; largest micro batch that fits: {largest}")
    lines += [f"note: {n}" for n in report["notes"]]
    lines += [f"warning: {w}" for w in report["warnings"]]
    if "speed" in report:
        lines += speed_lines(report["speed"], device=report.get("device_name"))
    for line in lines:
        # soft_wrap: the terminal wraps a long line; rich would break it at its own width (140 in a pipe)
        console.print(escape(line), highlight=False, soft_wrap=True)
