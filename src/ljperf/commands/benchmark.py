"""``ljperf benchmark``: train a model on synthetic tokens and measure throughput, MFU and memory.

Run: ``ljperf benchmark --model torch/llama-tiny --steps 10 --output result.json`` (``--nproc-per-node 2`` starts
torchrun; under a user's own torchrun each process is one rank). ``--help`` and a bad flag answer without torch.
"""

from __future__ import annotations

import argparse
import functools

from ljperf.benchmark.recovery import launch
from ljperf.core import options
from ljperf.core.options import EngineConfig, ExplainConfig, LaunchConfig, OptimConfig, TrainConfig
from ljperf.core.switches import enabled
from ljperf.dist.launch import under_torchrun
from ljperf.models.flags import add_model_arguments
from ljperf.run.config import check_flags


def add_arguments(parser: argparse.ArgumentParser, *, environment: bool = True) -> None:
    """The flags of ``ljperf benchmark``; ``environment``: ``CHECKPOINT_OPTIMIZATION=true`` makes ``--recompute``
    default to ``auto`` (off for a command whose runs are started without the variable)."""
    add_model_arguments(parser)
    parser.add_argument(
        "--output", metavar="FILE", help="write the JSON result record here (atomically); - for standard output"
    )
    options.add_arguments(parser, TrainConfig)
    options.add_arguments(parser, EngineConfig)
    options.add_arguments(parser, OptimConfig)
    if environment and enabled("CHECKPOINT_OPTIMIZATION"):
        parser.set_defaults(recompute="auto")
    parser.add_argument("--compile", action="store_true", help="same as --compile-mode regional")
    parser.set_defaults(compile_mode=None, warmup=None)  # to tell an explicit flag from the default
    options.add_arguments(parser, LaunchConfig)
    options.add_arguments(parser, ExplainConfig)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf benchmark``: one process runs the run, or ljperf's launcher starts its ranks. A bad
    flag value is refused before torch is imported."""
    flags = check_flags(args)
    from ljperf.benchmark.config import config_from_args
    from ljperf.benchmark.loop import run_worker
    from ljperf.benchmark.record import results_from_progress

    cfg = config_from_args(args, argv, flags=flags)
    if cfg.launch.distributed and not under_torchrun():
        return launch(cfg, record_from_progress=functools.partial(results_from_progress, cfg))
    picture = None
    if cfg.explain.plot is not None:
        from ljperf.plan.plot import benchmark_picture

        picture = functools.partial(benchmark_picture, cfg.explain.plot)
    return run_worker(cfg, picture=picture)
