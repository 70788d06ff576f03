"""``ljperf plan --search``: the plan command's flags made the search's axes (a flag given fixes its axis), the
search run with a progress bar, its table or ``--json``.

Run: ``ljperf plan --model llama3.1-8b --gpus 8 --gpu H100 --seq-len 8192 --search --global-batch 64``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Generator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ljperf.core import options
from ljperf.core.choices import EngineName
from ljperf.core.errors import EXIT_OK, UsageError
from ljperf.core.options import ClusterConfig, SearchConfig
from ljperf.forecast.recipe import Recipe
from ljperf.models.catalog import ENGINES
from ljperf.models.flags import engine_from_args
from ljperf.plan.device import device_memory
from ljperf.plan.search_space import RECOMPUTE_CHOICES, Axes
from ljperf.run import config as run_config

FSDP_FLAGS = ("tp", "dp_replicate", "pp", "reshard_after_forward")
DEEPSPEED_FLAGS = ("zero_stage", "deepspeed_config")


def engines_of(args: argparse.Namespace, given: set[str]) -> tuple[EngineName, ...]:
    """The engines searched: the one ``--model ENGINE/NAME`` or ``--engine`` names, else those the flags given
    allow (``--tp`` is FSDP2's, ``--zero-stage`` DeepSpeed's; ``--optimizer-impl`` and ``--precision bf16`` are not
    DeepSpeed's)."""
    if args.model and "/" in args.model:
        return (engine_from_args(args),)
    if args.model_config and args.engine:
        return (args.engine,)
    engines = [e for e in ENGINES if not (given & set(FSDP_FLAGS)) or e == "fsdp"]
    engines = [e for e in engines if not (given & set(DEEPSPEED_FLAGS)) or e == "deepspeed"]
    engines = [e for e in engines if e != "deepspeed" or not ("optimizer_impl" in given or args.precision == "bf16")]
    if not engines:
        raise UsageError(
            "--search: the flags given are of different engines (FSDP2's --tp, --dp-replicate, --pp,"
            " --no-reshard-after-forward; DeepSpeed's --zero-stage, --deepspeed-config): drop some"
        )
    return tuple(engines)


def axes_of(args: argparse.Namespace, given: set[str], *, engines: tuple[EngineName, ...]) -> Axes:
    """The search's axes: each flag given (``args`` as ``check_flags`` resolved them) fixes its own."""
    search = options.from_args(SearchConfig, args)
    fixed = {name: name in given for name in ("micro_batch", "grad_accum", "zero_stage", "tp", "dp_replicate", "pp")}
    return Axes(
        engines=engines,
        zero_stages=(args.zero_stage,) if fixed["zero_stage"] or args.deepspeed_config else (1, 2, 3),
        tp=args.tp if fixed["tp"] else None,
        dp_replicate=args.dp_replicate if fixed["dp_replicate"] else None,
        pp=args.pp if fixed["pp"] else None,
        reshard_after_forward=(args.reshard_after_forward,) if "reshard_after_forward" in given else (True, False),
        micro_batch=args.micro_batch if fixed["micro_batch"] or args.deepspeed_config else None,
        grad_accum=args.grad_accum if fixed["grad_accum"] or args.deepspeed_config else None,
        recompute=(args.recompute,) if "recompute" in given else RECOMPUTE_CHOICES,
        losses=(args.loss,) if "loss" in given else ("plain", "chunked"),
        optimizers=(args.optimizer_impl,) if "optimizer_impl" in given else ("fused", "foreach", "single"),
        global_batch=search.global_batch,
    )


def checked_args(args: argparse.Namespace, given: set[str]) -> tuple[argparse.Namespace, tuple[EngineName, ...]]:
    """``args`` as one plan of the search would take them: ``--model NAME`` gets an engine the flags allow (the
    search tries the others), ``--recompute`` and ``--memory-budget`` are the search's own."""
    if args.plot is not None:
        raise UsageError("--plot draws the memory of one plan: run ljperf plan without --search on a recipe it ranks")
    engines = engines_of(args, given)
    args = argparse.Namespace(**vars(args))
    if args.model and "/" not in args.model:
        args.model = f"{engines[0]}/{args.model}"
    elif args.model_config and not args.engine:
        args.engine = engines[0]
    if args.memory_budget is not None:
        options.from_args(
            options.OptimizationConfig, argparse.Namespace(recompute="auto", memory_budget=args.memory_budget)
        )
    args.memory_budget = None
    return args, engines


def search_command(args: argparse.Namespace, argv: list[str], *, given: set[str]) -> int:
    """Run the search on the flags ``given`` (the others' axes open); exit 2 when nothing fits."""
    budget_flag = args.memory_budget
    plan_args, engines = checked_args(args, given)
    flags = run_config.check_flags(plan_args, world=args.gpus)  # the flags' checks, with one engine of the search
    axes = axes_of(flags.args, given, engines=engines)
    cluster_flags = options.from_args(ClusterConfig, args)
    import torch

    from ljperf.plan.search import Setting, nothing_fits, search
    from ljperf.plan.search_report import print_search, search_record
    from ljperf.plan.speed import cluster_of
    from ljperf.recompute.budget import budget_bytes
    from ljperf.speed.step_time import device_rates

    cfg = run_config.from_args(plan_args, argv, device_type=args.device, flags=flags)
    memory, device_name = device_memory(gpu_memory=args.gpu_memory, gpu=args.gpu, device=args.device)
    base = Recipe.of(cfg, world=args.gpus, device=cfg.train.resolved_device)
    if device_rates(base, device_name=device_name, threads=cfg.train.threads) is None:
        raise UsageError(
            "--search ranks recipes by predicted speed, and no rates are known for a GPU named by --gpu-memory alone"
            " or not in the table: name a known one with --gpu"
        )
    setting = Setting(
        spec=cfg.model, base=base, axes=axes,
        budget=budget_bytes(torch.device(base.device), given=budget_flag, memory=memory),
        memory=memory, memory_budget=budget_flag, device_name=device_name, cluster=cluster_of(cluster_flags),
        threads=cfg.train.threads, per_node=cluster_flags.gpus_per_node or (8 if base.device == "cuda" else base.world),
        top=options.from_args(SearchConfig, args).top, jobs=os.cpu_count() or 1,
    )  # fmt: skip
    with progress_bar() as advance:
        outcome = search(setting, progress=advance)
    if not outcome.ranked():
        raise UsageError(nothing_fits(setting, outcome))
    record = search_record(setting, outcome, model=model_flags(args), extra=passed_through(args, given))
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print_search(record, top=options.from_args(SearchConfig, args).top)
    return EXIT_OK


def model_flags(args: argparse.Namespace) -> list[str]:
    """The model's flags of a ranked recipe's command, without the engine (each recipe names its own)."""
    if args.model:
        return ["--model", args.model.rpartition("/")[2]]
    return ["--model-config", args.model_config]


def passed_through(args: argparse.Namespace, given: set[str]) -> list[str]:
    """Flags of the search a ranked recipe's benchmark takes as they were given."""
    out = ["--threads", str(args.threads)] if "threads" in given else []
    return out + (["--deepspeed-config", args.deepspeed_config] if args.deepspeed_config else [])


@contextmanager
def progress_bar() -> Generator[Callable[[int, int], None]]:
    """A bar on a terminal's standard error: configurations searched of all (nothing in a pipe)."""
    if not sys.stderr.isatty():
        yield lambda done, total: None
        return
    bar = Progress(TextColumn("searching"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)  # fmt: skip
    task = bar.add_task("search", total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)
