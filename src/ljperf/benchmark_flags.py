"""The flags of ``ljperf benchmark``, without torch: ``ljperf benchmark --help`` and a mistyped flag answer at
once, before the run's imports (``ljperf.benchmark``).

Run: ``ljperf benchmark --help``.
"""

from __future__ import annotations

import argparse

from ljperf import config as cfgmod
from ljperf import models
from ljperf.config import EngineConfig, LaunchConfig, OptimConfig, TrainConfig
from ljperf.hooks import startup


def add_arguments(parser: argparse.ArgumentParser, *, environment: bool = True) -> None:
    """The flags of ``ljperf benchmark``; ``environment``: ``CHECKPOINT_OPTIMIZATION=true`` makes ``--recompute``
    default to ``auto`` (off for a command whose runs are started without the variable)."""
    models.add_model_arguments(parser)
    parser.add_argument("--output", metavar="FILE", help="write the JSON result record here (atomically)")
    cfgmod.add_arguments(parser, TrainConfig)
    cfgmod.add_arguments(parser, EngineConfig)
    cfgmod.add_arguments(parser, OptimConfig)
    if environment and startup.enabled("CHECKPOINT_OPTIMIZATION"):
        parser.set_defaults(recompute="auto")
    parser.add_argument("--compile", action="store_true", help="same as --compile-mode regional")
    parser.set_defaults(compile_mode=None, warmup=None)  # to tell an explicit flag from the default
    cfgmod.add_arguments(parser, LaunchConfig)
