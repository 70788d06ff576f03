"""``ljperf plan``: forecast the peak memory per GPU of a training recipe before it runs.

Run: ``ljperf plan --model deepspeed/llama3-8b --gpus 8 --gpu-memory 80GiB --micro-batch 1 --seq-len 8192``
or ``ljperf plan --model-config ./config.json --engine torch --device cpu --precision fp32 --json``;
``ljperf plan --calibrate results/*.json`` fits the device overheads from benchmark records (docs/forecast.md) and
the step-time model's efficiencies and links (docs/speed.md).
The recipe's flags are the benchmark's own (one definition each, ``core.options``); ``--help`` needs no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ljperf.commands.plan_search import search_command
from ljperf.core import hardware, options
from ljperf.core.choices import DeviceType, TracedAttention, values_of
from ljperf.core.console import say
from ljperf.core.errors import EXIT_DOES_NOT_FIT, EXIT_OK, UsageError
from ljperf.core.options import (
    ClusterConfig,
    EngineConfig,
    ExplainConfig,
    OptimizationConfig,
    SearchConfig,
    TrainConfig,
    positive,
)
from ljperf.core.parser import Parser
from ljperf.core.records import check_writable
from ljperf.core.units import format_bytes
from ljperf.forecast.calibrate import calibration_path, fit, save, valid_records
from ljperf.models.flags import add_model_arguments
from ljperf.plan.device import device_memory
from ljperf.run import config as run_config

TRAIN = ("micro_batch", "seq_len", "grad_accum", "precision", "attn_implementation", "device", "threads")
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
    options.add_arguments(parser, ClusterConfig)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    out.add_argument(
        "--calibrate",
        nargs="+",
        metavar="FILE",
        help="fit device overheads and the step-time model's efficiencies from benchmark records, links from"
        " ljperf comm records",
    )
    options.add_arguments(out, ExplainConfig, only=("plot",))
    options.add_arguments(parser, SearchConfig)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf plan``."""
    if args.calibrate:
        if args.model or args.model_config:
            raise UsageError("--calibrate fits the GPUs of the records it reads: it takes no --model or --model-config")
        if args.plot:
            raise UsageError("--plot draws the memory of a plan: it takes a --model, not --calibrate")
        return calibrate_command(args)
    positive("gpus", args.gpus)
    if options.from_args(SearchConfig, args).search:
        return search_command(args, argv, given=given_flags(argv))
    flags = run_config.check_flags(args, world=args.gpus)  # a bad value is refused before torch is imported
    cluster_flags = options.from_args(ClusterConfig, args)
    if args.plot is not None:
        check_writable(args.plot, what="--plot")
    from ljperf.plan.plot import plan_picture
    from ljperf.plan.record import planned, print_plan
    from ljperf.plan.speed import cluster_of

    cfg = run_config.from_args(args, argv, device_type=args.device, flags=flags)
    memory, device_name = device_memory(gpu_memory=args.gpu_memory, gpu=args.gpu, device=args.device)
    cluster = cluster_of(cluster_flags)
    report, decision = planned(cfg, world=args.gpus, memory=memory, device_name=device_name, cluster=cluster)
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


def given_flags(argv: list[str]) -> set[str]:
    """The ``dest`` of every flag ``argv`` gives (a default is no choice: the search's axes stay open)."""
    parser = Parser(prog="ljperf plan")
    add_arguments(parser)
    unset = object()
    marked = argparse.Namespace(**{a.dest: unset for a in parser._actions})
    own = argv[argv.index("plan") + 1 :] if "plan" in argv else argv
    parser.parse_known_args(own, namespace=marked)  # argparse sets no default where the namespace has a value
    return {name for name, value in vars(marked).items() if value is not unset}


def calibrate_command(args: argparse.Namespace) -> int:
    """Fit what the records tell: the memory overheads (benchmark records' forecasts and peaks), the step-time
    model's efficiencies (their predictions and measured steps) and links (``ljperf comm`` records)."""
    from ljperf.speed import calibrate as speed_calibrate

    records = valid_records(args.calibrate, what="--calibrate")
    fitted = fit(records)
    terms, links = speed_calibrate.fit(records)
    if not (fitted or terms or links):
        raise UsageError(
            "--calibrate: no record holds a forecast and a measured peak, a step-time prediction and timed steps,"
            " or timed collectives (run ljperf benchmark or ljperf comm)"
        )
    if fitted:
        save(fitted)
    speed_path = speed_calibrate.save(terms, links) if terms or links else None
    if args.json:
        devices = {name: asdict(terms) for name, terms in fitted.items()}
        print(
            json.dumps(
                {
                    "kind": "calibration",
                    "saved_to": str(calibration_path()),
                    "devices": devices,
                    "speed": {
                        "saved_to": str(speed_path) if speed_path else None,
                        "devices": {name: asdict(t) for name, t in terms.items()},
                        "links": {name: asdict(link) for name, link in links.items()},
                    },
                },
                indent=2,
            )
        )
        return 0
    for name, terms_ in fitted.items():
        print(
            f"{name}: scale {terms_.scale:.4f}, offset {format_bytes(terms_.offset)}, "
            f"reserved/allocated {f'{terms_.reserved_scale:.3f}' if terms_.reserved_scale else '-'} from"
            f" {terms_.samples} record(s)"
        )
    for line in speed_calibrate.describe(terms, links):
        print(line)
    if fitted:
        print(f"saved to {calibration_path()}")
    if speed_path:
        print(f"speed terms saved to {speed_path}")
    return 0
