"""``ljperf comm``: time collectives over torch.distributed the way nccl-tests does, and check their results.

Run: ``ljperf comm --nproc-per-node 8 --ops all_reduce,all_gather,reduce_scatter --min-bytes 1K --max-bytes 1G``
(NCCL on GPUs, gloo on CPU); ``--help`` and a bad flag answer without torch.
"""

from __future__ import annotations

import argparse

from ljperf.comm.config import CommConfig
from ljperf.core import options
from ljperf.core.console import check_output
from ljperf.core.options import LaunchConfig
from ljperf.distributed.launch import under_torchrun


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ljperf comm``."""
    parser.add_argument("--output", metavar="FILE", help="write the JSON result record here (atomically)")
    options.add_arguments(parser, CommConfig)
    options.add_arguments(parser, LaunchConfig)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf comm``: start the ranks, or be one. A bad flag value is refused before torch is
    imported."""
    cfg = options.from_args(CommConfig, args)
    launch = options.from_args(LaunchConfig, args)
    from ljperf.comm.bench import launch as launch_ranks
    from ljperf.comm.bench import run_worker
    from ljperf.distributed.runtime import check_process_count, resolve_device_type

    device_type = resolve_device_type(cfg.device)
    check_process_count(launch, device_type)
    if args.output is not None and not under_torchrun():
        check_output(args.output)
    if launch.distributed and not under_torchrun():
        return launch_ranks(argv, launch, device_type=device_type, output=args.output)
    return run_worker(cfg, launch, device_type=device_type, output=args.output, argv=argv)
