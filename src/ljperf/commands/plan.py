"""``ljperf plan``: forecast the peak memory per GPU of a training recipe before it runs.

Run: ``ljperf plan --model deepspeed/llama3-8b --gpus 8 --gpu-memory 80GiB --micro-batch 1 --seq-len 8192``
or ``ljperf plan --model-config ./config.json --engine torch --device cpu --precision fp32 --json``;
``ljperf plan --calibrate results/*.json`` fits the device overheads from benchmark records (docs/forecast.md).
The recipe's flags are the benchmark's own (one definition each, ``core.options``); ``--help`` needs no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ljperf.core import hardware, options
from ljperf.core.choices import DeviceType, TracedAttention, values_of
from ljperf.core.console import say
from ljperf.core.errors import EXIT_DOES_NOT_FIT, EXIT_OK, UsageError
from ljperf.core.options import EngineConfig, ExplainConfig, OptimizationConfig, TrainConfig, positive
from ljperf.core.records import check_writable
from ljperf.core.units import format_bytes
from ljperf.forecast.calibrate import calibrate, calibration_path
from ljperf.models.flags import add_model_arguments
from ljperf.plan.device import device_memory
from ljperf.run import config as run_config

TRAIN = ("micro_batch", "seq_len", "grad_accum", "precision", "attn_implementation", "device")
EPILOG = (
    f'exit codes: {EXIT_OK} it fits; {EXIT_DOES_NOT_FIT} it does NOT fit (the table, or --json with "fits": false, is'
    " still printed; with --recompute auto one line on stderr says what would fit); 2 bad input"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ljperf plan``: the recipe (the benchmark's flags where it has them), the memory, output."""
    parser.epilog = EPILOG
    add_model_arguments(parser)
    g = parser.add_argument_group("recipe")
    g.add_argument(
        "--gpus",
        type=int,
        default=1,
        metavar="N",
        help="GPUs in all, the world size: data-parallel ranks × --tp (default: 1)",
    )
    # what the forecast traces: a device type (auto would be this machine's), the attention it knows
    narrow = {"device": values_of(DeviceType), "attn_implementation": values_of(TracedAttention)}
    options.add_arguments(g, TrainConfig, only=TRAIN, defaults={"device": "cuda"}, choices=narrow)
    options.add_arguments(g, OptimizationConfig, only=("recompute", "optimizer_impl", "loss"))
    options.add_arguments(g, EngineConfig)
    m = parser.add_argument_group("memory")
    m.add_argument("--gpu-memory", metavar="SIZE", help="memory per device, e.g. 80GiB (default: this machine's)")
    m.add_argument(
        "--gpu",
        metavar="NAME",
        help="a known GPU instead, at the capacity torch reports (H100-80GB: 79.11 GiB): "
        + ", ".join(hardware.GPU_MEMORY_BYTES),
    )
    options.add_arguments(m, OptimizationConfig, only=("memory_budget",))
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    out.add_argument("--calibrate", nargs="+", metavar="FILE", help="fit device overheads from benchmark records")
    options.add_arguments(out, ExplainConfig, only=("plot",))


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf plan``."""
    if args.calibrate:
        if args.model or args.model_config:
            raise UsageError("--calibrate fits the GPUs of the records it reads: it takes no --model or --model-config")
        if args.plot:
            raise UsageError("--plot draws the memory of a plan: it takes a --model, not --calibrate")
        return calibrate_command(args)
    positive("gpus", args.gpus)
    flags = run_config.check_flags(args, world=args.gpus)  # a bad value is refused before torch is imported
    if args.plot is not None:
        check_writable(args.plot, what="--plot")
    from ljperf.plan.plot import plan_picture
    from ljperf.plan.record import planned, print_plan

    cfg = run_config.from_args(args, argv, device_type=args.device, flags=flags)
    memory, device_name = device_memory(gpu_memory=args.gpu_memory, gpu=args.gpu, device=args.device)
    report, decision = planned(cfg, world=args.gpus, memory=memory, device_name=device_name)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_plan(report)
    if args.plot is not None:
        plan_picture(args.plot, cfg=cfg, report=report, device_name=device_name)
        if not args.json:  # standard output holds the JSON alone
            say(f"memory picture: {args.plot}")
    if decision is not None and not decision.fits:
        print(f"ljperf plan: {decision.line()}", file=sys.stderr)
    return EXIT_OK if report["fits"] else EXIT_DOES_NOT_FIT


def calibrate_command(args: argparse.Namespace) -> int:
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
