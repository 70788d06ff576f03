"""``ljperf report DIR``: re-render an ablation's report (terminal table, report.md, PNG chart) from its JSON.

Run: ``ljperf report runs/llama3-8b``. Writes ``summary.json``, ``report.md`` and ``ablation.png`` into DIR.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ljperf.ablation.report import SUMMARY, load_records, render
from ljperf.core.errors import EXIT_OK, UsageError
from ljperf.core.records import read_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ljperf report``."""
    parser.add_argument("dir", metavar="DIR", help="the --out folder of an ljperf ablation")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf report``."""
    out = Path(args.dir)
    if not out.is_dir():
        raise UsageError(
            f"{out}: {'not a folder' if out.exists() else 'no such folder'}; give the --out folder of ljperf ablation"
        )
    records = load_records(out)
    previous = out / SUMMARY
    try:
        command = read_json(previous).get("args")
    except (OSError, ValueError, AttributeError):  # none yet, or damaged: the report is written anew
        command = None
    render(out, records, command=command)
    return EXIT_OK
