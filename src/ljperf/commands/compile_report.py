"""``ljperf compile-report``: graph breaks, recompiles and compile time per region, eager vs compiled step time.

Run: ``ljperf compile-report --model torch/llama-tiny --seq-lens 512,1000,2048 [--repeats 3] [--output r.json]``.
One process: graph breaks with their reasons and source lines, then the model compiled in place and ``--repeats``
rounds of eager and compiled steps at each length, interleaved (``benchmark.compile_report``). ``--help`` and a
bad flag answer without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import asdict, dataclass
from typing import ClassVar

from ljperf.core import options
from ljperf.core.choices import TORCH_COMPILE_MODES, TorchCompileMode, refuse, values_of
from ljperf.core.console import check_output
from ljperf.core.errors import EXIT_SIGINT, EXIT_SIGTERM, UsageError
from ljperf.core.options import LARGEST, OptimizationConfig, TrainConfig, opt, positive
from ljperf.core.records import write_json
from ljperf.models.flags import add_model_arguments, engine_from_args, model_files, spec_from_args
from ljperf.run.config import RunConfig, resolve_train


@dataclass(kw_only=True)
class ReportConfig:
    """What compile-report runs: lengths, rounds, steps per length, compile mode."""

    TITLE: ClassVar[str] = "report"

    seq_lens: str = opt("512,1000,2048", "comma-separated sequence lengths, run in this order", metavar="N[,N]")
    repeats: int = opt(
        3,
        "rounds of eager then compiled steps at each length, interleaved; the table shows min–max over them and"
        " marks a speedup whose ranges overlap with ≈",
        metavar="N",
    )

    def __post_init__(self) -> None:
        positive("repeats", self.repeats)
        try:
            lens = [int(x) for x in self.seq_lens.split(",") if x.strip()]
        except ValueError:
            raise UsageError(
                f"--seq-lens {self.seq_lens!r} must be integers separated by commas, e.g. 512,1024"
            ) from None
        if not lens or not 2 <= min(lens) <= max(lens) <= LARGEST:
            raise UsageError(f"--seq-lens {self.seq_lens!r}: give one or more lengths from 2 to {LARGEST}")
        if len(set(lens)) < len(lens):
            raise UsageError(f"--seq-lens {self.seq_lens!r} names a length twice: each is one row of the report")

    @property
    def lengths(self) -> list[int]:
        return [int(x) for x in self.seq_lens.split(",") if x.strip()]


SHARED = ("micro_batch", "steps", "device", "precision", "threads")
"""The benchmark's flags compile-report takes: ``--steps`` timed steps per length (after one untimed step),
eager and compiled."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ljperf compile-report``."""
    add_model_arguments(parser, engines=("torch",))  # one process: the regions are every engine's
    parser.add_argument("--output", metavar="FILE", help="write the JSON report here (atomically)")
    options.add_arguments(parser, ReportConfig)
    group = parser.add_argument_group("run")
    options.add_arguments(group, TrainConfig, only=SHARED, defaults={"steps": 3}, deepspeed=False)
    modes = {"compile_mode": values_of(TorchCompileMode)}
    options.add_arguments(
        group, OptimizationConfig, only=("compile_mode",), defaults={"compile_mode": "regional"}, choices=modes
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf compile-report``; a bad flag value is refused before torch is imported."""
    if engine_from_args(args) != "torch":
        raise UsageError(f"compile-report runs one process: use --model torch/{args.model.split('/')[-1]}")
    cfg = options.from_args(ReportConfig, args)
    train, optim = options.from_args(TrainConfig, args), options.from_args(OptimizationConfig, args)
    if (mode := optim.compile_mode) not in TORCH_COMPILE_MODES:  # the parser's choices refuse it already
        refuse("--compile-mode", mode, TorchCompileMode)
    check_output(args.output, inputs=model_files(args.model_config))
    from ljperf.benchmark.compile_report import compile_report, print_report
    from ljperf.distributed.runtime import resolve_device_type
    from ljperf.run.context import RunContext, init_process

    spec = spec_from_args(args)
    device_type = resolve_device_type(train.device)
    train = dataclasses.replace(train, seq_len=max(cfg.lengths))
    train = resolve_train(train, model=spec, device_type=device_type, seq_flag="--seq-lens")
    # the engine trains eager first; the report compiles it in place afterwards
    run_ctx = init_process(RunContext(config=RunConfig(engine="torch", model=spec, train=train)), need_group=False)
    given = {**asdict(cfg), **{name: getattr(args, name) for name in SHARED}, "compile_mode": mode}
    given["threads"] = train.threads  # as resolved: the threads that ran on a CPU
    keys = ("seq_lens", "repeats", "steps", "micro_batch", "compile_mode", "device", "precision", "threads")
    given = {key: given[key] for key in keys}
    report = compile_report(run_ctx, cfg.lengths, mode=mode, repeats=cfg.repeats, config=given, argv=argv)
    print_report(report)
    if args.output:
        write_json(args.output, report)
    if report["status"] != "ok":  # interrupted: what was measured is printed and kept
        kept = f"; partial result kept: {args.output}" if args.output and args.output != "-" else ""
        print(f"ljperf compile-report: {report['reason']}{kept}", file=sys.stderr)
        return EXIT_SIGINT if report["reason"].endswith("SIGINT") else EXIT_SIGTERM
    return 0
