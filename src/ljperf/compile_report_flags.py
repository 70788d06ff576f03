"""The flags of ``ljperf compile-report``, without torch (``--help`` and a mistyped flag answer at once).

Run: ``ljperf compile-report --help``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ljperf import config as cfgmod
from ljperf import models
from ljperf.config import COMPILE_MODES, LARGEST, opt, positive
from ljperf.errors import UsageError


@dataclass(kw_only=True)
class ReportConfig:
    """What compile-report runs: lengths, steps per length, compile mode."""

    seq_lens: str = opt("512,1000,2048", "comma-separated sequence lengths, run in this order")
    steps: int = opt(3, "timed steps per length (after one untimed step), eager and compiled")
    micro_batch: int = opt(1, "sequences per step")
    compile_mode: str = opt("regional", "regional or whole", choices=COMPILE_MODES[:2])
    device: str = opt("auto", "cpu, cuda or auto")
    precision: str | None = opt(
        None, "fp32, bf16-mixed or bf16, as ljperf benchmark (default: bf16-mixed on GPU, fp32 on CPU)"
    )

    def __post_init__(self) -> None:
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
        positive("steps", self.steps)
        positive("micro_batch", self.micro_batch)

    @property
    def lengths(self) -> list[int]:
        return [int(x) for x in self.seq_lens.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ljperf compile-report``."""
    models.add_model_arguments(parser, engines=("torch",))  # one process: the regions are every engine's
    parser.add_argument("--output", metavar="FILE", help="write the JSON report here (atomically)")
    cfgmod.add_arguments(parser, ReportConfig)
