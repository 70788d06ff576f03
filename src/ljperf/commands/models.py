"""``ljperf models``: the model catalog with its parameter counts (exact ones in ``--json``).

Run: ``ljperf models`` or ``ljperf models --json``; the counts come from a meta-device build, kept on disk, so a
second listing builds nothing and imports no torch.
"""

from __future__ import annotations

import argparse
import json

from ljperf.core.console import console, titled_table
from ljperf.models.catalog import catalog_names
from ljperf.models.spec import format_params, resolve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def catalog_rows() -> list[dict]:
    rows = []
    for name in catalog_names():
        spec = resolve(name=name)
        rows.append(
            {
                "name": name,
                "architecture": spec.architecture,
                "params": spec.params.total,
                "params_active": spec.params.active,
                "layers": spec.layers,
                "hidden": spec.hidden,
                "heads": spec.heads,
                "kv_heads": spec.kv_heads,
                "vocab": spec.vocab,
                "max_positions": spec.max_positions,
            }
        )
    return rows


def run(args: argparse.Namespace, argv: list[str]) -> int:
    rows = catalog_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = titled_table("ljperf model catalog (use as --model ENGINE/NAME)")
    table.add_column("name")
    table.add_column("architecture")
    # a mixture of experts uses fewer parameters per token than it holds: its FLOPs and MFU count those
    for col in ("params", "active params", "layers", "hidden", "heads/kv", "vocab", "max positions"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["name"],
            r["architecture"],
            format_params(r["params"]),
            format_params(r["params_active"]),
            str(r["layers"]),
            str(r["hidden"]),
            f"{r['heads']}/{r['kv_heads']}",
            f"{r['vocab']:,}",
            f"{r['max_positions']:,}",
        )
    console.print(table)
    return 0
