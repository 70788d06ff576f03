"""The ``ljperf`` command: one dispatch table of typed subcommands.

Run ``ljperf --help``; each subcommand module has ``add_arguments(parser)`` and ``run(args, argv) -> int``.
Bad input exits 2 with one line on stderr; a failed run exits non-zero with one line (no traceback).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import signal
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import NoReturn

from ljperf import __version__
from ljperf.errors import (
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    EXIT_USAGE,
    Interrupted,
    RunFailed,
    UsageError,
    interruption,
)

EXIT_SIGPIPE = 141
"""What a shell reports for a command whose reader closed the pipe (``ljperf models --json | head``)."""


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help and the module that implements it."""

    help: str
    module: str
    flags: str | None = None
    """The module with its ``add_arguments``, where ``module`` imports torch: ``--help`` and a bad flag answer
    without it (``module`` is imported once the flags parse, under the start-up signal handlers)."""


COMMANDS: dict[str, Command] = {
    "benchmark": Command(
        "train a model on synthetic tokens and measure throughput, MFU and memory",
        "ljperf.benchmark",
        flags="ljperf.benchmark_flags",
    ),
    "models": Command("list the model catalog with parameter counts", "ljperf.list_models"),
    "plan": Command("forecast peak memory per GPU of a recipe before it runs; --calibrate", "ljperf.forecast.cli"),
    "doctor": Command("check driver, NCCL, DeepSpeed config, versions, compile; each with a fix", "ljperf.doctor.cli"),
    "comm": Command(
        "measure collectives (all_reduce, all_gather, ...): time, algbw, busbw, #wrong",
        "ljperf.comm",
        flags="ljperf.comm_flags",
    ),
    "ablation": Command(
        "measure each optimization's contribution: variants × repeats, report",
        "ljperf.ablation.cli",
        flags="ljperf.ablation.flags",
    ),
    "report": Command("re-render an ablation's report (table, report.md, PNG) from its JSON", "ljperf.ablation.report"),
    "compile-report": Command(
        "graph breaks, recompiles, compile time per region, eager vs compiled step time",
        "ljperf.compile_report",
        flags="ljperf.compile_report_flags",
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2) instead of the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.endswith("expected one argument"):
            # argparse reads a value that starts with "-" (``--memory-budget -5GiB``) as the next flag
            message += "; a value that starts with '-' is written --flag=VALUE"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (torch loads only when a command needs it)."""
    parser = _Parser(prog="ljperf", description="Measure, fit and speed up LLM training on PyTorch.")
    parser.add_argument("--version", action="version", version=f"ljperf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, cmd in COMMANDS.items():
        child = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if name == command:
            importlib.import_module(cmd.flags or cmd.module).add_arguments(child)
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> NoReturn:
    """Exit 2 naming the flags ``command`` does not know, with the closest one it does (a typo's fix)."""
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    child = sub.choices[command]
    child.error(unrecognized(child, unknown))


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


def _terminated(signum: int, _frame: object) -> None:
    # Not SystemExit: raised inside an import it can come out as another error (transformers' lazy modules
    # re-raise it as ModuleNotFoundError, with a traceback). Commands with something to clean up (benchmark
    # and ablation runs, torch elastic's agent) install their own handler before they start anything.
    sys.stderr.flush()
    os.write(2, f"ljperf: interrupted by {signal.Signals(signum).name}\n".encode())
    os._exit(EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM)


def _hand_to_launcher(exc: UsageError) -> bool:
    """Under ljperf's launcher, leave a rank's usage error in the run folder: the ranks all find the same one,
    and whichever exits first, the launcher prints it once. False anywhere else."""
    from ljperf.launch import RunFolder

    folder, rank = RunFolder.watching(), os.environ.get("RANK")
    return folder is not None and rank is not None and folder.leave_usage_error(str(exc), rank=rank)


def main(argv: list[str] | None = None) -> int:
    # A signal while the command's module imports (torch, transformers): exit 130/143, no traceback. Ctrl-C is
    # a KeyboardInterrupt again once the command runs (ablation stops its running benchmark on it).
    signal.signal(signal.SIGTERM, _terminated)
    interrupt = signal.getsignal(signal.SIGINT)
    if interrupt is not signal.SIG_IGN:  # a background job started with Ctrl-C ignored keeps ignoring it
        signal.signal(signal.SIGINT, _terminated)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(command)
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        print("ljperf: error: name a command (see ljperf --help)", file=sys.stderr)
        return EXIT_USAGE
    if unknown:
        _refuse_unknown(parser, args.command, unknown)
    module = importlib.import_module(COMMANDS[args.command].module)
    signal.signal(signal.SIGINT, signal.default_int_handler if interrupt is None else interrupt)  # None: set in C
    return _run_command(module, args, argv)


def entry() -> NoReturn:
    """The ``ljperf`` process (console script and ``python -m ljperf``): ``main``'s code is its exit status."""
    code = main()
    dist = sys.modules.get("torch.distributed")
    group_open = dist is not None and dist.is_available() and dist.is_initialized()
    # Two ways the interpreter's own exit would replace this code, so leave at once (ljperf's clean-up is done):
    # - a failed rank leaves its process group as it is (a peer may be gone); at exit gloo's threads can then
    #   meet the group's destructor and abort (SIGABRT);
    # - a Ctrl-C that landed inside exec() of source (dataclasses, namedtuple) is flagged unhandled though it
    #   was caught, and ``python -m`` then kills itself with SIGINT (status -2, not 130).
    if code == EXIT_SIGINT or (code != EXIT_OK and group_open):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _run_command(module: ModuleType, args: argparse.Namespace, argv: list[str]) -> int:
    """Run a subcommand's module; its failures become one line and an exit code."""
    prog = f"ljperf {args.command}"
    try:
        code = module.run(args, argv)
        sys.stdout.flush()  # a reader that stopped early (| head) shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SIGPIPE
    except UsageError as exc:
        if not _hand_to_launcher(exc) and os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {exc}", file=sys.stderr)  # under a user's torchrun every rank finds the same
        return EXIT_USAGE
    except RunFailed as exc:
        print(f"{prog}: failed: {exc}", file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except Exception as exc:
        if (stop := interruption(exc)) is None:  # a bug: its traceback is what a report needs
            raise
        print(f"{prog}: {stop}", file=sys.stderr)
        return stop.exit_code
