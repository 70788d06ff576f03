"""``ljperf ablation``: run each variant in a fresh benchmark process, repeated and interleaved, then report.

Run: ``ljperf ablation --model torch/llama-tiny --variants base,compile,compile+ckpt --repeat 3 --out runs/tiny``.
Every ``ljperf benchmark`` flag is shared by all variants; ``--variant NAME="--flags"`` defines a variant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ljperf.ablation import report, runner
from ljperf.ablation.variants import BUILTIN, DEFAULT_VARIANTS, Variant, parse_environments, parse_variants
from ljperf.commands import benchmark as benchmark_command
from ljperf.core.console import say
from ljperf.core.errors import EXIT_ERROR, EXIT_OK, RunFailed, UsageError
from ljperf.core.options import LARGEST, Deprecated
from ljperf.core.parser import Parser, unrecognized
from ljperf.core.records import check_writable

if TYPE_CHECKING:
    from ljperf.run.config import RunConfig


def add_ablation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the ablation itself (everything else goes to each ``ljperf benchmark``)."""
    builtin = ", ".join(f"{name} ({flags or 'no flags'})" for name, flags in BUILTIN.items())
    group = parser.add_argument_group("ablation")
    group.add_argument(
        "--variants",
        metavar="NAME[,NAME]",
        help=f"variants in order, the first is the baseline (default: {','.join(DEFAULT_VARIANTS)}, "
        f"or the --variant definitions); built in: {builtin}",
    )
    group.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="define (or redefine) a variant as extra benchmark flags; repeatable",
    )
    group.add_argument(
        "--repeat", type=int, default=3, metavar="N", help="runs per variant, interleaved A B C A B C (default: 3)"
    )
    group.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=PYTHON",
        help="run the variants under this interpreter (which can import ljperf); repeatable (default: this one)",
    )
    group.add_argument(
        "--out",
        "--output",
        dest="out",
        metavar="DIR",
        help="folder of the run records and report; an existing one is resumed (default: ablation-ENGINE-MODEL)",
    )
    group.add_argument("--force", action="store_true", help="re-run finished runs in --out instead of resuming")
    group.add_argument(
        "--run-timeout",
        type=float,
        default=3600.0,
        metavar="N",
        help="seconds one run may take (start-up and compile included) before it is stopped (default: 3600); a"
        " hung collective inside a run is --collective-timeout",
    )
    group.add_argument(
        "--timeout", dest="run_timeout", type=float, action=Deprecated, new="--run-timeout", help=argparse.SUPPRESS
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by all variants), then the ablation's, which replace the same-named ones."""
    benchmark_command.add_arguments(parser)
    parser.conflict_handler = "resolve"  # the ablation's old --timeout and --out/--output replace the benchmark's
    parser.allow_abbrev = False  # shared flags are passed on verbatim: abbreviations would not survive
    add_ablation_arguments(parser)


def split_argv(argv: list[str], command: str) -> list[str]:
    """The benchmark flags of the command line: everything that is not an ablation flag."""
    own = Parser(allow_abbrev=False, add_help=False, raising=True)
    add_ablation_arguments(own)
    _, shared = own.parse_known_args(argv[argv.index(command) + 1 :])
    return shared


def check_variant(shared: list[str], variant: Variant) -> RunConfig:
    """Parse and validate the variant's benchmark command here, before any run starts."""
    from ljperf.benchmark.config import config_from_args

    # No help flag: a variant's --help would print the benchmark's help and end the ablation (exit 0) unnoticed.
    parser = Parser(prog="ljperf benchmark", allow_abbrev=False, add_help=False, raising=True)
    benchmark_command.add_arguments(parser, environment=False)  # the runs start without CHECKPOINT_OPTIMIZATION
    try:
        args, unknown = parser.parse_known_args([*shared, *variant.flags])
        if unknown:
            raise UsageError(unrecognized(parser, unknown))
        if args.output:
            raise UsageError("--output is set by the ablation for each run; drop it from the variant")
        if args.profile or args.plot:  # every run would write the same files; report.md shows each breakdown
            raise UsageError("--profile and --plot are for one run: run ljperf benchmark with the variant's flags")
        return config_from_args(args, [])
    except UsageError as exc:
        where = f"variant {variant.name} ({variant.text})" if variant.flags else f"variant {variant.name}"
        raise UsageError(f"{where}: {exc}") from None


def warn_untested_recompute(variants: list[Variant], configs: list[RunConfig]) -> None:
    """Before the runs: each CPU variant whose ``--recompute auto`` has no budget, the RAM holding the whole run,
    would recompute nothing; say so, with a budget that would test it (forecast here, cached for the runs)."""
    from ljperf.recompute.run import untested_auto

    for variant, cfg in zip(variants, configs, strict=True):
        if line := untested_auto(cfg):
            say(f"variant {variant.name}: {line}")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf ablation``."""
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1 (got {args.repeat})")
    if not 0 < args.run_timeout <= LARGEST:
        raise UsageError(f"--run-timeout must be larger than zero and at most {LARGEST} (got {args.run_timeout:g})")
    shared = split_argv(argv, args.command)
    variants = parse_variants(args.variants, args.variant)
    configs = [check_variant(shared, v) for v in variants]
    warn_untested_recompute(variants, configs)
    environments = parse_environments(args.env, default_python=sys.executable)
    # A --model-config path names its folder or file, not a folder tree under the working directory.
    out = Path(args.out or f"ablation-{configs[0].engine}-{Path(configs[0].model.name).name.removesuffix('.json')}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file; give a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        check_writable(out / report.SUMMARY, what="--out")
    except OSError as exc:
        raise UsageError(f"--out {str(out)!r}: cannot create it ({exc.strerror or exc})") from None
    plan = runner.plan(shared=shared, variants=variants, environments=environments, repeat=args.repeat)
    records = runner.run_all(plan, out=out, timeout=args.run_timeout, force=args.force)
    report.render(out, records, command=argv)
    failed = sum(r["results"]["status"] != "ok" for r in records)
    if failed:
        raise RunFailed(f"{failed} of {len(records)} runs failed (see {out / report.MARKDOWN})", exit_code=EXIT_ERROR)
    return EXIT_OK
