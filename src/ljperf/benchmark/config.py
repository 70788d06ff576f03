"""A benchmark's ``RunConfig`` from its flags, with what only a benchmark checks before any process starts:
processes for the cores or GPUs, a writable ``--output`` (and ``--profile`` folder, ``--plot`` file), a DeepSpeed
config that resolves.

Run: ``config_from_args(args, argv)`` (``ljperf benchmark``, and ``ljperf ablation`` for each variant).
"""

from __future__ import annotations

import argparse
import os

from ljperf.core.console import check_output
from ljperf.core.records import check_distinct_outputs, check_output_folder, check_writable
from ljperf.distributed.launch import under_torchrun
from ljperf.distributed.runtime import check_process_count
from ljperf.engines.deepspeed_engine import resolved_config
from ljperf.models.flags import model_files
from ljperf.run import config as run_config
from ljperf.run.config import RunConfig
from ljperf.run.context import unjoined


def config_from_args(args: argparse.Namespace, argv: list[str], *, flags: run_config.Flags | None = None) -> RunConfig:
    """The run of ``ljperf benchmark``'s parsed flags, checked (exit 2 on bad input); ``flags``: already checked."""
    cfg = run_config.from_args(args, argv, flags=flags)
    check_process_count(cfg.launch, cfg.train.resolved_device)
    written = ("rank*.trace.json.gz", "rank*.memory.pickle")
    check_distinct_outputs(
        {"--output": cfg.output, "--plot": cfg.explain.plot}, folders={"--profile": (cfg.explain.profile, written)}
    )
    if cfg.output is not None and os.environ.get("GROUP_RANK", "0") == "0":
        # Rank 0's node writes it, under any launcher. All its ranks check: one blocked joining the group would
        # not see torchrun's SIGTERM, and would hold the run 30 s until its SIGKILL.
        check_output(cfg.output, inputs=(args.deepspeed_config, *model_files(args.model_config)))
    if cfg.explain.plot is not None and os.environ.get("GROUP_RANK", "0") == "0":
        check_writable(cfg.explain.plot, what="--plot")
    if cfg.explain.profile is not None:  # every node's ranks write their traces there
        check_output_folder(cfg.explain.profile, what="--profile", file_name="rank0.trace.json.gz")
    if cfg.engine == "deepspeed" and not under_torchrun():
        # A contradicting DeepSpeed config fails here (exit 2), before any process starts.
        resolved_config(unjoined(cfg, world=cfg.launch.nproc_per_node * cfg.launch.nnodes))
    return cfg
