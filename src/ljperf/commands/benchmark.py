"""``ljperf benchmark``: train a model on synthetic tokens and measure throughput, MFU and memory.

Run: ``ljperf benchmark --model torch/llama-tiny --steps 10 --output result.json`` (``--nproc-per-node 2`` starts
torchrun; under a user's own torchrun each process is one rank). ``--help`` and a bad flag answer without torch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

from ljperf.benchmark.recovery import launch
from ljperf.core import options
from ljperf.core.errors import UsageError
from ljperf.core.options import EngineConfig, ExplainConfig, LaunchConfig, OptimizationConfig, TrainConfig
from ljperf.core.parser import Parser
from ljperf.core.switches import enabled
from ljperf.distributed.launch import under_torchrun
from ljperf.models.flags import add_model_arguments
from ljperf.run.config import check_flags


def add_arguments(parser: argparse.ArgumentParser, *, environment: bool = True) -> None:
    """The flags of ``ljperf benchmark``; ``environment``: ``CHECKPOINT_OPTIMIZATION=true`` makes ``--recompute``
    default to ``auto`` (off for a command whose runs are started without the variable)."""
    add_model_arguments(parser)
    parser.add_argument(
        "--recipe",
        metavar="FILE",
        help="run a recipe of ljperf plan --search --json: the file's first ranked one, or one entry of its ranked or"
        " evaluated list saved alone; flags given here add to the recipe's (--steps, --output, --node-rank), and one"
        " it sets is refused",
    )
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
    if args.recipe is not None:
        argv = recipe_argv(args.recipe, argv)
        parser = Parser(prog="ljperf benchmark")
        add_arguments(parser)
        args = parser.parse_args(argv[1:])
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


def recipe_argv(path: str, argv: list[str]) -> list[str]:
    """The benchmark argv of the recipe in ``path`` (a search record's first ranked recipe, or one entry of it)
    followed by ``argv``'s own flags but ``--recipe``; a flag in both is refused."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--recipe {path!r}: cannot read it as JSON ({exc})") from None
    if isinstance(data, dict) and data.get("kind") == "search":
        if not data.get("ranked"):
            raise UsageError(f"--recipe {path!r}: the search ranked no recipe (nothing fit)")
        data = data["ranked"][0]
    recipe = data.get("argv") if isinstance(data, dict) else None
    if not (isinstance(recipe, list) and recipe[:1] == ["benchmark"] and all(isinstance(a, str) for a in recipe)):
        raise UsageError(
            f"--recipe {path!r}: not a recipe of ljperf plan --search --json (its record, or one entry with an argv"
            " that starts with benchmark)"
        )
    own = argv[argv.index("benchmark") + 1 :] if "benchmark" in argv else list(argv)
    i = next(k for k, a in enumerate(own) if a == "--recipe" or a.startswith("--recipe="))
    own = own[:i] + own[i + (1 if "=" in own[i] else 2) :]
    flag_names = {a.split("=", 1)[0] for a in recipe if a.startswith("--")}
    both = [a for a in own if a.startswith("--") and a.split("=", 1)[0] in flag_names]
    if both:
        raise UsageError(f"--recipe {path!r} sets {both[0]} already: drop it here, or edit the recipe")
    return [*recipe, *own]


def _say_threads(threads: int) -> None:
    """A CPU run whose thread count nobody chose (no ``--threads``, no ``OMP_NUM_THREADS``) times the machine's
    load as much as ljperf: 1.26-1.55x apart in two runs of one comparison, 1.009x with one thread each."""
    if not (os.environ.get("OMP_NUM_THREADS") or under_torchrun()):
        print(
            f"ljperf benchmark: {threads} CPU thread(s) per process (this machine's cores shared among its processes):"
            " step times follow the machine's load; give --threads N (or OMP_NUM_THREADS) to compare runs",
            file=sys.stderr,
        )
