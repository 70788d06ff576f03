"""``ljperf plan``: forecast the peak memory per GPU of a training recipe before it runs.

Run: ``ljperf plan --model deepspeed/llama3-8b --gpus 8 --gpu-memory 80GiB --micro-batch 1 --seq-len 8192``
or ``ljperf plan --model-config ./config.json --engine torch --device cpu --precision fp32 --json``;
``ljperf plan --calibrate results/*.json`` fits the device overheads from benchmark records (docs/forecast.md).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from ljperf import config as cfgmod
from ljperf import deepspeed_config, hardware, models
from ljperf.checkpoint import fixed_plan, parse_recompute
from ljperf.config import EngineConfig, OptimConfig, TrainConfig, check_zero_stage, positive
from ljperf.errors import UsageError
from ljperf.forecast.recipe import Forecast, Recipe, ZeroSettings, deepspeed_adamw
from ljperf.models import ModelSpec
from ljperf.units import format_bytes, parse_memory, unit_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    models.add_model_arguments(parser)
    g = parser.add_argument_group("recipe")
    g.add_argument("--gpus", type=int, default=1, help="data-parallel ranks, the world size (default: 1)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="device the job runs on (default: cuda)")
    cfgmod.add_arguments(g, TrainConfig, only=("micro_batch", "seq_len", "grad_accum", "precision"))
    g.add_argument(
        "--recompute",
        default="none",
        help="none, full, selective, K (the first K layers full), a mode per layer (full,selective,none,...) or auto"
        " (the fastest plan that fits) (default: none)",
    )
    g.add_argument(
        "--attn-implementation",
        choices=("sdpa", "eager"),
        help="transformers attention: eager keeps the seq² attention weights (default: sdpa, or eager for a model"
        " without SDPA, such as Gemma 2, as transformers picks)",
    )
    cfgmod.add_arguments(g, EngineConfig, only=("zero_stage", "reshard_after_forward"))
    g.add_argument(
        "--deepspeed-config",
        metavar="PATH",
        help="the job's DeepSpeed JSON config, checked as ljperf benchmark checks it: the forecast reads its micro "
        "batch, accumulation and ZeRO stage (where the flags are not given), reduce_bucket_size and stage3 "
        "prefetch, max-live and reuse-distance settings (deepspeed engine)",
    )
    g.add_argument("--optimizer", choices=("single", "foreach", "fused"), help="AdamW kind (default: torch's pick)")
    m = parser.add_argument_group("memory")
    m.add_argument("--gpu-memory", metavar="SIZE", help="memory per device, e.g. 80GiB (default: this machine's)")
    m.add_argument(
        "--gpu",
        metavar="NAME",
        help="a known GPU instead, at the capacity torch reports (H100-80GB: 79.11 GiB): "
        + ", ".join(hardware.GPU_MEMORY_BYTES),
    )
    cfgmod.add_arguments(m, OptimConfig, only=("memory_budget",))
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    out.add_argument("--calibrate", nargs="+", metavar="RECORD", help="fit device overheads from benchmark records")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf plan``."""
    if args.calibrate:
        if args.model or args.model_config:
            raise UsageError("--calibrate fits the GPUs of the records it reads: it takes no --model or --model-config")
        return calibrate_command(args)
    from ljperf.forecast.api import forecast, max_micro_batch

    engine, spec = models.model_from_args(args)
    recipe, warnings = recipe_from_args(args, engine=engine, spec=spec)
    memory, device_name = device_memory(args)
    decision = None
    if args.recompute == "auto":
        from ljperf.checkpoint.solver import solve_for_plan

        decision, rates = solve_for_plan(spec, recipe, memory=memory, device_name=device_name, given=args.memory_budget)
        recipe = recipe.with_(recompute=decision.plan)
    result = forecast(spec, recipe, device_name=device_name)
    most = recipe.with_(recompute=("full",) * spec.layers) if decision else recipe  # the most auto can save
    budget = decision.budget_bytes if decision else None  # auto's limit: fits, headroom and the largest batch
    # a budget above the device's memory bounds the plan (the note below says it may not run), not the batch
    best = max_micro_batch(spec, most, min(budget or memory, memory), device_name=device_name)
    report = plan_record(spec, recipe, result, memory=memory, budget=budget, max_micro_batch=best, warnings=warnings)
    if decision is not None:
        report["recompute"] = decision.record() | {"rates": rates}
        report["notes"].append("largest micro batch counted with full recompute, the most --recompute auto saves")
        if decision.budget_bytes > memory:
            report["notes"].append(
                f"the memory budget {format_bytes(decision.budget_bytes)} is more than the device's "
                f"{format_bytes(memory)}: a plan within it can still run out of memory"
            )
    elif not report["fits"] and set(recipe.layer_modes(spec.layers)) != {"full"}:
        at_full = forecast(spec, recipe.with_(recompute=("full",) * spec.layers), device_name=device_name)
        full = at_full.device_bytes
        shard = "a sharding engine (fsdp/, deepspeed/)" if recipe.engine == "torch" else "more --gpus"
        less = "fewer tokens per micro-step (--micro-batch, --seq-len)"
        if at_full.phase.startswith("optimizer"):  # tokens do not reach it; the AdamW kind's temporaries do
            less = "the optimizer step sets that peak: --optimizer fused (no step temporaries)"
        report["notes"].append(
            f"with --recompute full: {format_bytes(full)} on the device, "
            + ("which fits; --recompute auto recomputes the fewest layers that fit" if full <= memory else
               f"which does not fit either: {less} or {shard}")
        )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_plan(report)
    if decision is not None and not decision.fits:
        raise UsageError(decision.line())
    return 0


def recipe_from_args(
    args: argparse.Namespace, *, engine: str, spec: ModelSpec
) -> tuple[Recipe, list[deepspeed_config.Finding]]:
    """The recipe of the flags and --deepspeed-config, and the config's lint warnings."""
    # checked first, as ljperf benchmark checks them: a 0 would fall through ``or`` to a default, or be reported
    # as contradicting --deepspeed-config
    positive("gpus", args.gpus)
    TrainConfig(
        micro_batch=args.micro_batch, seq_len=args.seq_len, grad_accum=args.grad_accum, precision=args.precision
    )
    cfgmod.check_engine_flags(engine, zero_stage=args.zero_stage, reshard_after_forward=args.reshard_after_forward)
    if args.zero_stage is not None:
        check_zero_stage(args.zero_stage)
    seq_len = spec.seq_len(args.seq_len)
    cfgmod.check_budget_flags(recompute=args.recompute, memory_budget=args.memory_budget)
    precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "fp32")
    cfgmod.check_precision(precision, engine=engine)
    user, batch = deepspeed_config.from_args(args, engine=engine)
    warnings, zero = [], ZeroSettings()
    if user:
        config = deepspeed_config.merge(user)
        source = f"--deepspeed-config {args.deepspeed_config}"
        warnings = deepspeed_config.check(config, batch, world=args.gpus, bf16=precision == "bf16-mixed", source=source)
        zero = ZeroSettings.from_config(config)
    recipe = Recipe(
        engine=engine,
        zero_stage=batch.zero_stage,
        zero=zero,
        world=args.gpus,
        device=args.device,
        precision=precision,
        micro_batch=batch.micro_batch,
        seq_len=seq_len,
        grad_accum=batch.grad_accum,
        attn_implementation=spec.attention(args.attn_implementation),
        reshard_after_forward=args.reshard_after_forward,
        recompute=() if args.recompute == "auto" else fixed_plan(parse_recompute(args.recompute), spec.layers),
        optimizer=args.optimizer or deepspeed_adamw(user),
    )
    return recipe, warnings


def device_memory(args: argparse.Namespace) -> tuple[int, str | None]:
    """(bytes per device, the name its calibration is saved under) from --gpu-memory, --gpu or this machine;
    --gpu-memory takes the name of this machine's device (a CUDA plan on a machine without a GPU: none)."""
    if args.gpu_memory and args.gpu:
        raise UsageError("give one of --gpu-memory SIZE or --gpu NAME")
    if args.gpu:
        if args.device == "cpu":
            raise UsageError("--gpu names a GPU, but the plan is for --device cpu: give --gpu-memory SIZE instead")
        name = known_gpu(args.gpu)
        return hardware.GPU_MEMORY_BYTES[name], name.split("-")[0]
    import torch

    if args.device == "cpu":
        here = "cpu"
    else:
        here = hardware.calibration_name(torch.device("cuda", 0)) if torch.cuda.is_available() else None
    if args.gpu_memory:
        return parse_memory(args.gpu_memory, what="--gpu-memory"), here
    if here is None:
        raise UsageError("no GPU here to read its memory from: give --gpu-memory SIZE or --gpu NAME")
    if here == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), here
    return torch.cuda.get_device_properties(0).total_memory, here


def known_gpu(text: str) -> str:
    """The entry of ``hardware.GPU_MEMORY_BYTES`` that --gpu ``text`` names, in any case: the whole name
    (``h100-80gb``), or the model alone (``H100``) where only one size of it is known."""
    table = hardware.GPU_MEMORY_BYTES
    candidates = [name for name in table if name.lower() == text.lower()] or [
        name for name in table if name.split("-")[0].lower() == text.lower()
    ]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise UsageError(f"--gpu {text!r} names {len(candidates)} GPUs: choose one of {', '.join(candidates)}")
    raise UsageError(f"--gpu {text!r} is not known; choose one of {', '.join(table)}")


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
    from ljperf.forecast.timeline import block_params
    from ljperf.result import SCHEMA_VERSION

    recipe_dict = asdict(recipe)
    recipe_dict["recompute"] = list(recipe.layer_modes(spec.layers))
    if recipe.engine != "deepspeed":
        del recipe_dict["zero_stage"], recipe_dict["zero"]
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
        "gpu_memory_bytes": memory,
        "memory_budget_bytes": budget,
        "headroom_bytes": (budget or memory) - result.device_bytes,
        "fits": result.device_bytes <= (budget or memory),
        "max_micro_batch": max_micro_batch,
        "notes": result.notes,
        "warnings": [f"{f.message}; fix: {f.fix}" for f in warnings],
    }


def print_plan(report: dict) -> None:
    from rich.markup import escape

    from ljperf.report import console, shape_title, titled_table

    recipe = report["recipe"]
    where = f"{recipe['world']} × {recipe['device']}"
    table = titled_table(shape_title(recipe["engine"], report["model"]["name"], where=where, shape=recipe))
    peak = report["peak_allocated_bytes"]
    unit, scale = unit_of(peak)  # one unit for the column, the peak's (tiny models read 0.00 in GiB)
    table.add_column("component")
    table.add_column(unit, justify="right")
    table.add_column("share", justify="right")
    for name, value in sorted(report["breakdown"].items(), key=lambda kv: -kv[1]):
        table.add_row(name.replace("_", " "), f"{value / scale:.2f}", f"{100 * value / peak:.1f}%")
    table.add_section()
    table.add_row("peak allocated per rank", f"{peak / scale:.2f}", "100.0%")
    console.print(table)
    lines = [f"peak at: {report['phase']} ({report['source']})"]
    if "recompute" in report:
        from ljperf.checkpoint import describe

        r = report["recompute"]
        lines.insert(
            0, f"recompute auto: {describe(r['plan'])} (budget {format_bytes(r['budget_bytes'])}; {r['rates']})"
        )
    if report["peak_reserved_bytes"] is not None:
        lines.append(
            f"reserved {format_bytes(report['peak_reserved_bytes'])} + context {format_bytes(report['context_bytes'])}"
            f" = {format_bytes(report['device_bytes'])} on the device"
        )
    verdict = "fits" if report["fits"] else "does NOT fit"
    where = format_bytes(report["gpu_memory_bytes"])
    if (budget := report["memory_budget_bytes"]) is not None:
        where = f"the budget {format_bytes(budget)} (device {where})"
    lines.append(
        f"{verdict} in {where}: headroom {format_bytes(report['headroom_bytes'])};"
        f" largest micro batch that fits: {report['max_micro_batch']}"
    )
    lines += [f"note: {n}" for n in report["notes"]]
    lines += [f"warning: {w}" for w in report["warnings"]]
    for line in lines:
        # soft_wrap: the terminal wraps a long line; rich would break it at its own width (140 in a pipe)
        console.print(escape(line), highlight=False, soft_wrap=True)


def calibrate_command(args: argparse.Namespace) -> int:
    from ljperf.forecast.calibrate import calibrate, calibration_path

    fitted = calibrate(args.calibrate)
    if args.json:
        devices = {name: asdict(terms) for name, terms in fitted.items()}
        print(json.dumps({"kind": "calibration", "saved_to": str(calibration_path()), "devices": devices}, indent=2))
        return 0
    for name, terms in fitted.items():
        print(
            f"{name}: scale {terms.scale:.4f}, offset {format_bytes(terms.offset)}, "
            f"reserved/allocated {f'{terms.reserved_scale:.3f}' if terms.reserved_scale else '-'} from"
            f" {terms.samples} record(s)"
        )
    print(f"saved to {calibration_path()}")
    return 0
