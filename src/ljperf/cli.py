"""The ``ljperf`` command: one dispatch table of typed subcommands.

Run ``ljperf --help``; each subcommand's module in ``ljperf.commands`` has ``add_arguments(parser)`` and
``run(args, argv) -> int``, and imports torch only inside ``run``.
Bad input exits 2 with one line on stderr; a failed run exits non-zero with one line (no traceback).
"""

from __future__ import annotations

import argparse
import errno
import gc
import importlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import NoReturn

from ljperf import __version__
from ljperf.core.errors import (
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGPIPE,
    EXIT_SIGTERM,
    EXIT_USAGE,
    Interrupted,
    RunFailed,
    UsageError,
    cut,
    forget_signals,
    interruption,
    note_interrupt,
    noted_interruption,
)
from ljperf.core.gc_pause import pause_collection, resume_collection
from ljperf.core.options import deprecations
from ljperf.core.parser import Parser, unrecognized
from ljperf.distributed.launch import LAUNCHER_ENV, RunFolder, end_with_parent

RANK_0_GRACE_S = 60.0


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help and the module (in ``ljperf.commands``) with its flags and ``run``."""

    help: str
    module: str
    resumes_collection: bool = False
    """Its ``run`` resumes garbage collection where its work starts (``core.gc_pause``); else it resumes before
    ``run``."""


COMMANDS: dict[str, Command] = {
    "benchmark": Command(
        "train a model on synthetic tokens and measure throughput, MFU and memory",
        "ljperf.commands.benchmark",
        resumes_collection=True,
    ),
    "models": Command("list the model catalog with parameter counts", "ljperf.commands.models"),
    "plan": Command(
        "forecast peak memory per GPU of a recipe before it runs, or fit the forecast's device overheads to"
        " benchmark records (--calibrate)",
        "ljperf.commands.plan",
    ),
    "doctor": Command(
        "check driver, NCCL, DeepSpeed config, versions, compile; each with a fix", "ljperf.commands.doctor"
    ),
    "comm": Command(
        "measure collectives (all_reduce, all_gather, ...): time, algbw, busbw, #wrong", "ljperf.commands.comm"
    ),
    "ablation": Command(
        "measure each optimization's contribution: variants × repeats, report", "ljperf.commands.ablation"
    ),
    "report": Command("re-render an ablation's report (table, report.md, PNG) from its JSON", "ljperf.commands.report"),
    "compile-report": Command(
        "graph breaks, recompiles, compile time per region, eager vs compiled step time",
        "ljperf.commands.compile_report",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (torch loads only when a command needs it)."""
    parser = Parser(prog="ljperf", description="Measure, fit and speed up LLM training on PyTorch.")
    parser.add_argument("--version", action="version", version=f"ljperf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, cmd in COMMANDS.items():
        child = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if name == command:
            importlib.import_module(cmd.module).add_arguments(child)
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> NoReturn:
    """Exit 2 naming the flags ``command`` does not know, with the closest one it does (a typo's fix)."""
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    child: argparse.ArgumentParser = sub.choices[command]
    child.error(unrecognized(child, unknown))


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
    folder, rank = RunFolder.watching(), os.environ.get("RANK")
    return folder is not None and rank is not None and folder.leave_usage_error(str(exc), rank=rank)


def _outlived_rank_0() -> bool:
    """Under a user's torchrun every rank finds the same usage error, and rank 0 says it. A rank that exits first
    has torchrun stop rank 0 before it can, so wait for the SIGTERM torchrun sends once rank 0 has exited, and end
    silently with the usage code. True: rank 0 did not end within the grace (another node's agent is not told),
    so this rank says it. False at once outside torchrun (another launcher's ranks leave the line to rank 0)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_USAGE))
    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_SIGINT))  # Ctrl-C reaches every rank: no traceback
    time.sleep(RANK_0_GRACE_S)
    return True


def main(argv: list[str] | None = None) -> int:
    # A signal while the command's module imports (torch, transformers): exit 130/143, no traceback. Ctrl-C is
    # a KeyboardInterrupt again once the command runs (ablation stops its running benchmark on it).
    signal.signal(signal.SIGTERM, _terminated)
    forget_signals()
    if (launcher := os.environ.get(LAUNCHER_ENV)) is not None and "RANK" in os.environ:
        end_with_parent(int(launcher))  # a rank of ljperf's launcher: when it dies (kill -9 too), so do the ranks
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
    if os.environ.get("RANK", "0") == "0":  # said once, not by every rank
        for line in deprecations(args):
            print(f"ljperf {args.command}: {line}", file=sys.stderr)
    module = importlib.import_module(COMMANDS[args.command].module)
    # None: set in C. Python's own handler, but noted: an import can swallow its KeyboardInterrupt.
    python_default = interrupt is None or interrupt is signal.default_int_handler
    signal.signal(signal.SIGINT, note_interrupt if python_default else interrupt)
    return _run_command(module, args, argv)


def entry() -> NoReturn:
    """The ``ljperf`` process (console script and ``python -m ljperf``): ``main``'s code is its exit status."""
    pause_collection()
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
    # The interpreter's exit would collect garbage over every object torch and transformers made, ~0.8 CPU-s a
    # process; frozen, they are left to the process's end (ljperf's files are closed, its groups ended by now).
    gc.freeze()
    sys.exit(code)


def _run_command(module: ModuleType, args: argparse.Namespace, argv: list[str]) -> int:
    """Run a subcommand's module; its failures become one line and an exit code."""
    prog = f"ljperf {args.command}"
    if not COMMANDS[args.command].resumes_collection:
        resume_collection()
    try:
        code = module.run(args, argv)
        sys.stdout.flush()  # a reader that stopped early (| head) shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SIGPIPE
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:  # any other is a bug or a fault, whose traceback a report needs
            raise
        # A path given to the command (output, config, folder): whichever check first touched it
        print(cut(f"{prog}: error: a path is longer than this system allows: {exc.filename!r}"), file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        if _hand_to_launcher(exc):
            return EXIT_USAGE
        if (rank := os.environ.get("RANK", "0")) == "0" or _outlived_rank_0():
            print(cut(f"{prog}: error: {exc}" + ("" if rank == "0" else f" (rank {rank})")), file=sys.stderr)
        return EXIT_USAGE
    except RunFailed as exc:
        print(cut(f"{prog}: {exc.word}: {exc}"), file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except Exception as exc:
        # A Ctrl-C inside an import may come out as another error: torch's C++ init turns the KeyboardInterrupt
        # into "TypeError: expected a message argument"; the noted signal says what it was.
        if (stop := interruption(exc) or noted_interruption()) is None:  # a bug: its traceback is what a report needs
            raise
        print(f"{prog}: {stop}", file=sys.stderr)
        return stop.exit_code
