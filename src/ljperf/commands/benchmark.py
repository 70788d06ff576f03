"""``ljperf benchmark``: train a model on synthetic tokens and measure throughput, MFU and memory.

Run: ``ljperf benchmark --model torch/llama-tiny --steps 10 --output result.json`` (``--nproc-per-node 2`` starts
torchrun; under a user's own torchrun each process is one rank). ``--help`` and a bad flag answer without torch.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from ljperf.benchmark.recovery import launch
from ljperf.core import options
from ljperf.core.options import EngineConfig, ExplainConfig, LaunchConfig, OptimizationConfig, TrainConfig
from ljperf.core.switches import enabled
from ljperf.distributed.launch import under_torchrun
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
    options.add_arguments(parser, OptimizationConfig)
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
        code = launch(cfg, record_from_progress=functools.partial(results_from_progress, cfg))
    else:
        picture = None
        if cfg.explain.plot is not None:
            from ljperf.plan.plot import benchmark_picture

            picture = functools.partial(benchmark_picture, cfg.explain.plot)
        code = run_worker(cfg, picture=picture)
    # under the table: a refusal stays one line; a CPU run's threads are resolved
    if code == 0 and cfg.train.device == "cpu" and args.threads is None and cfg.train.threads is not None:
        _say_threads(cfg.train.threads)
    return code


def _say_threads(threads: int) -> None:
    """A CPU run whose thread count nobody chose (no ``--threads``, no ``OMP_NUM_THREADS``) times the machine's
    load as much as ljperf: 1.26-1.55x apart in two runs of one comparison, 1.009x with one thread each."""
    if not (os.environ.get("OMP_NUM_THREADS") or under_torchrun()):
        print(
            f"ljperf benchmark: {threads} CPU thread(s) per process (this machine's cores shared among its processes):"
            " step times follow the machine's load; give --threads N (or OMP_NUM_THREADS) to compare runs",
            file=sys.stderr,
        )
