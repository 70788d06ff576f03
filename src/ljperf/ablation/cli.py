"""``ljperf ablation``: run each variant in a fresh benchmark process, repeated and interleaved, then report.

Run: ``ljperf ablation --model torch/llama-tiny --variants base,compile,compile+ckpt --repeat 3 --out runs/tiny``.
Every ``ljperf benchmark`` flag is shared by all variants; ``--variant NAME="--flags"`` defines a variant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ljperf import benchmark, benchmark_flags, cli
from ljperf.ablation import report, runner
from ljperf.ablation.flags import add_ablation_arguments
from ljperf.ablation.variants import Variant, parse_environments, parse_variants
from ljperf.config import LARGEST
from ljperf.errors import EXIT_ERROR, EXIT_OK, RunFailed, UsageError
from ljperf.result import check_writable


class _Strict(argparse.ArgumentParser):
    """A parser whose errors are UsageErrors (exit 2, one line)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def split_argv(argv: list[str], command: str) -> list[str]:
    """The benchmark flags of the command line: everything that is not an ablation flag."""
    own = _Strict(allow_abbrev=False, add_help=False)
    add_ablation_arguments(own)
    _, shared = own.parse_known_args(argv[argv.index(command) + 1 :])
    return shared


def check_variant(shared: list[str], variant: Variant) -> benchmark.BenchmarkConfig:
    """Parse and validate the variant's benchmark command here, before any run starts."""
    # No help flag: a variant's --help would print the benchmark's help and end the ablation (exit 0) unnoticed.
    parser = _Strict(prog="ljperf benchmark", allow_abbrev=False, add_help=False)
    benchmark_flags.add_arguments(parser, environment=False)  # the runs start without CHECKPOINT_OPTIMIZATION
    try:
        args, unknown = parser.parse_known_args([*shared, *variant.flags])
        if unknown:
            raise UsageError(cli.unrecognized(parser, unknown))
        if args.output:
            raise UsageError("--output is set by the ablation for each run; drop it from the variant")
        return benchmark.config_from_args(args, [])
    except UsageError as exc:
        where = f"variant {variant.name} ({variant.text})" if variant.flags else f"variant {variant.name}"
        raise UsageError(f"{where}: {exc}") from None


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf ablation``."""
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1 (got {args.repeat})")
    if not 0 < args.timeout <= LARGEST:
        raise UsageError(f"--timeout must be larger than zero and at most {LARGEST} (got {args.timeout:g})")
    shared = split_argv(argv, args.command)
    variants = parse_variants(args.variants, args.variant)
    configs = [check_variant(shared, v) for v in variants]
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
    records = runner.run_all(plan, out=out, timeout=args.timeout, force=args.force)
    report.render(out, records, command=argv)
    failed = sum(r["results"]["status"] != "ok" for r in records)
    if failed:
        raise RunFailed(f"{failed} of {len(records)} runs failed (see {out / report.MARKDOWN})", exit_code=EXIT_ERROR)
    return EXIT_OK
