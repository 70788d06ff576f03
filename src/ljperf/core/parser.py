"""ljperf's argument parser: a usage error is one line and exit 2 (or a ``UsageError`` where a command parses
flags of its own), and an unknown flag is answered with the flag ljperf has for it.

Run: ``Parser(prog="ljperf plan").parse_args([...])``; ``unrecognized(parser, ["--batch-size", "8"])`` →
``unrecognized arguments: --batch-size 8; did you mean --micro-batch N (...)?``.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn

from ljperf.core.errors import EXIT_USAGE, UsageError, cut


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2) instead of the usage block; with ``raising``, a
    ``UsageError`` (the ablation checks each variant's benchmark flags before any run starts)."""

    def __init__(self, *args: Any, raising: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.raising = raising

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):
            # argparse reads a value that starts with "-" (``--memory-budget -5GiB``) as the next flag
            message += "; a value that starts with '-' is written --flag=VALUE"
        if self.raising:
            raise UsageError(message)
        self.exit(EXIT_USAGE, cut(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


def unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """The error for arguments ``parser`` does not know, with ljperf's flag for the first (``suggest_flag``)."""
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-")]
    hint = suggest_flag(flags[0], known) if flags else None
    return f"unrecognized arguments: {' '.join(unknown)}" + (f"; did you mean {hint}?" if hint else "")


PEER_FLAGS: dict[str, tuple[str, ...]] = {
    "--nproc-per-node": ("--gpus N (the world size: processes per node × nodes)",),
    "--nnodes": ("--gpus N (the world size: processes per node × nodes)",),
    "--world-size": ("--nproc-per-node N", "--gpus N"),
    "--num-gpus": ("--nproc-per-node N", "--gpus N"),
    "--gpus": ("--nproc-per-node N (and --nnodes for several machines)",),
    "--batch-size": ("--micro-batch N (sequences per device per micro-step)",),
    "--micro-batch-size": ("--micro-batch N",),
    "--per-device-train-batch-size": ("--micro-batch N",),
    "--train-micro-batch-size-per-gpu": ("--micro-batch N",),
    "--gradient-accumulation-steps": ("--grad-accum N",),
    "--max-steps": ("--steps N",),
    "--train-iters": ("--steps N",),
    "--seq-length": ("--seq-len N",),
    "--max-seq-len": ("--seq-len N",),
    "--max-length": ("--seq-len N",),
    "--block-size": ("--seq-len N",),
    "--bf16": ("--precision bf16-mixed",),
    "--fp32": ("--precision fp32",),
    "--gradient-checkpointing": ("--recompute full (or auto: the fastest plan that fits)",),
    "--activation-checkpointing": ("--recompute full (or auto: the fastest plan that fits)",),
    "--recompute-activations": ("--recompute full (or auto: the fastest plan that fits)",),
    "--torch-compile": ("--compile",),
    "--learning-rate": ("--lr",),
    "--deepspeed": ("--engine deepspeed (and --deepspeed-config PATH)",),
    "--fsdp": ("--engine fsdp",),
}
"""Flags of torchrun, the HF Trainer, DeepSpeed and Megatron-LM that users carry over, with ljperf's
equivalents; a command gets the first whose flag it has (``plan --nproc-per-node`` is ``--gpus``)."""


def suggest_flag(flag: str, known: list[str]) -> str | None:
    """ljperf's flag for a flag a command does not know: the same with dashes for underscores, a peer tool's
    equivalent (``PEER_FLAGS``; None if the command has none), or else the closest spelling."""
    dashed = flag.replace("_", "-").lower()
    if dashed in known:
        return dashed
    if dashed in PEER_FLAGS:  # a flag of another tool: its spelling says nothing of this command's flags
        return next((hint for hint in PEER_FLAGS[dashed] if hint.split()[0] in known), None)
    # Compared without the dashes, which every flag shares: with them "--help" came close to "--steps".
    close = difflib.get_close_matches(dashed.lstrip("-"), [k.lstrip("-") for k in known], n=1)
    return f"--{close[0]}" if close else None
