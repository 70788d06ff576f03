"""The flags of ``ljperf ablation``, without torch (``--help`` and a mistyped flag answer at once).

Run: ``ljperf ablation --help``.
"""

from __future__ import annotations

import argparse

from ljperf import benchmark_flags
from ljperf.ablation.variants import BUILTIN, DEFAULT_VARIANTS


def add_ablation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the ablation itself (everything else goes to each ``ljperf benchmark``)."""
    builtin = ", ".join(f"{name} ({flags or 'no flags'})" for name, flags in BUILTIN.items())
    group = parser.add_argument_group("ablation")
    group.add_argument(
        "--variants",
        metavar="A,B,...",
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
    group.add_argument("--repeat", type=int, default=3, help="runs per variant, interleaved A B C A B C (default: 3)")
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
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds one run may take (start-up and compile included) before it is stopped (default: 3600)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by all variants), then the ablation's, which replace the same-named ones."""
    benchmark_flags.add_arguments(parser)
    parser.conflict_handler = "resolve"  # the ablation's --timeout and --out/--output replace the benchmark's
    parser.allow_abbrev = False  # shared flags are passed on verbatim: abbreviations would not survive
    add_ablation_arguments(parser)
