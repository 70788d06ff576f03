"""``ljperf doctor``: run the checks, print OK / WARN / FAIL / INFO rows with their fixes.

Run: ``ljperf doctor``, ``ljperf doctor --deepspeed-config ds.json --world-size 8 --json``,
``ljperf doctor --skip compile`` (the image's health check). Exit 0 unless a check FAILs (exit 1);
a bad flag or an unreadable ``--deepspeed-config`` exits 2.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict

from rich.markup import escape

from ljperf.core.console import check_output, console, titled_table
from ljperf.core.errors import EXIT_OK, RunFailed, UsageError, describe
from ljperf.core.hardware import cpu_name
from ljperf.core.records import record_header, write_json
from ljperf.doctor import checks
from ljperf.doctor.checks import FAIL, INFO, OK, WARN, CheckResult

# Machine checks in the order they are shown; the DeepSpeed lint runs first when a file is given.
CHECKS: dict[str, Callable[[], CheckResult]] = {
    "driver": checks.check_driver,
    "nccl-ifname": checks.check_nccl_ifname,
    "nccl": checks.check_nccl,
    "versions": checks.check_versions,
    "compile": checks.check_compile,
}
_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red", INFO: "cyan"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ljperf doctor``."""
    parser.add_argument("--deepspeed-config", metavar="FILE", help="lint this DeepSpeed JSON config too")
    parser.add_argument(
        "--world-size", type=int, metavar="N", help="data-parallel processes, for the config's batch identity"
    )
    parser.add_argument("--skip", default="", metavar="CHECK[,CHECK]", help=f"checks to leave out: {', '.join(CHECKS)}")
    parser.add_argument("--json", action="store_true", help="print the JSON record instead of the table")
    parser.add_argument("--output", metavar="FILE", help="also write the JSON record here (atomically)")


def skipped(text: str) -> set[str]:
    names = {s.strip() for s in text.split(",") if s.strip()}
    unknown = sorted(names - set(CHECKS))
    if unknown:
        raise UsageError(f"--skip {','.join(unknown)}: no such check (choose from {', '.join(CHECKS)})")
    return names


def run_checks(*, deepspeed: str | None, world_size: int | None, skip: set[str]) -> list[CheckResult]:
    rows = checks.check_deepspeed_config(deepspeed, world_size=world_size) if deepspeed else []
    return rows + [guarded(name, check) for name, check in CHECKS.items() if name not in skip]


def guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """Run one check; a check that crashes is a FAIL row, not a traceback (the other checks still run)."""
    try:
        return check()
    except Exception as exc:
        return CheckResult(
            check=name,
            status=FAIL,
            finding=f"the check itself failed: {describe(exc)}",
            fix="report it with the output of `ljperf doctor --json`",
        )


def overall(rows: list[CheckResult]) -> str:
    """The worst status: FAIL, else WARN, else OK (INFO rows do not count)."""
    statuses = {r.status for r in rows}
    return next((s for s in (FAIL, WARN) if s in statuses), OK)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf doctor``."""
    if args.world_size is not None and args.world_size <= 0:
        raise UsageError(f"--world-size must be larger than zero (got {args.world_size})")
    skip = skipped(args.skip)
    check_output(args.output, inputs=(args.deepspeed_config,))
    rows = run_checks(deepspeed=args.deepspeed_config, world_size=args.world_size, skip=skip)
    status = overall(rows)
    record = {
        **record_header("doctor", args=argv, devices=_devices(), world_size=1),
        "results": {"status": status, "checks": [asdict(r) for r in rows]},
    }
    if args.output:
        write_json(args.output, record)
    if args.json:
        print(json.dumps(record, indent=2, default=str))
    else:
        print_table(rows, status)
    if failed := [r.check for r in rows if r.status == FAIL]:
        raise RunFailed(failure_line(failed))
    return EXIT_OK


def failure_line(failed: list[str]) -> str:
    """The failed checks, each named once (``deepspeed-config ×2`` when it failed on two rows)."""
    counts = Counter(failed)
    names = ", ".join(name if n == 1 else f"{name} ×{n}" for name, n in counts.items())
    return f"{names} (see {'its fix' if len(failed) == 1 else 'their fixes'})"


def _devices() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [cpu_name()]


def print_table(rows: list[CheckResult], status: str) -> None:
    table = titled_table("ljperf doctor")
    table.add_column("check")
    table.add_column("status")
    table.add_column("finding")
    table.add_column("fix")
    for r in rows:
        table.add_row(r.check, f"[{_STYLE[r.status]}]{r.status}[/]", escape(r.finding), escape(r.fix))
    counts = Counter(r.status for r in rows)
    table.caption = f"{status} · " + " · ".join(f"{counts[s]} {s}" for s in (OK, WARN, FAIL, INFO))
    console.print(table)
