"""A multi-process benchmark through ljperf's launcher, and its record kept when a rank fails.

Run: ``ljperf benchmark --model torch/llama-tiny --nproc-per-node 2`` calls ``launch``. When a rank dies, the
launcher names it, ends the others, and writes the result record with ``status: "error"`` and the steps rank 0
completed (from the run folder's ``progress.jsonl``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ljperf.benchmark.table import last_line, print_result_table
from ljperf.core.errors import EXIT_DIVERGED, EXIT_OOM, EXIT_USAGE, RunFailed
from ljperf.core.records import STDOUT, read_json, write_json
from ljperf.distributed.launch import RUN_DIR_ENV, RunFolder, failure_reason, run_workers
from ljperf.run.config import RunConfig

KEPT_STATUS = {EXIT_OOM: "oom", EXIT_DIVERGED: "diverged"}
"""A rank's exit code whose status the record keeps (another rank may only have seen its peer vanish)."""


def launch(cfg: RunConfig, *, record_from_progress: Callable[[Path], dict[str, Any]]) -> int:
    """Run ``cfg`` on ``nproc_per_node`` processes of this node (one node of ``nnodes``); when rank 0 died before
    writing its record, ``record_from_progress(progress.jsonl)`` makes one from the steps it reported."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    folder = RunFolder(Path(tempfile.mkdtemp(prefix="ljperf-run-")))
    os.environ[RUN_DIR_ENV] = str(folder.path)
    output = cfg.output if cfg.output != STDOUT else None
    to_file = output is not None
    record_path = Path(output) if output is not None else folder.path / "result.json"
    argv = list(cfg.argv)
    if not to_file:  # rank 0 writes it in the run folder; the launcher passes on a record for stdout
        argv += ["--output", str(record_path)]
    try:
        run_workers(argv, cfg.launch, cpu=cfg.train.device != "cuda")
        if cfg.output == STDOUT:
            write_json(STDOUT, read_json(record_path))
    except SignalException as exc:
        reason, code = failure_reason(exc, folder=folder)
        _keep_failed_record(
            cfg, record_path=record_path, folder=folder, reason=reason, record_from_progress=record_from_progress
        )
        print(last_line(reason, interrupted=True, output=cfg.output), file=sys.stderr)
        return code
    except Exception as exc:
        reason, code = failure_reason(exc, folder=folder)
        if code == EXIT_USAGE and (message := folder.usage_error()) is not None:
            # Refused before training, as a one-process run would be: one line, no record (cli._hand_to_launcher).
            print(f"ljperf benchmark: error: {message}", file=sys.stderr)
            return code
        results = _keep_failed_record(
            cfg,
            record_path=record_path,
            folder=folder,
            reason=reason,
            record_from_progress=record_from_progress,
            kept=KEPT_STATUS.get(code),
        )
        code = next((c for c, status in KEPT_STATUS.items() if status == results["status"]), code)
        word = results["status"] if results["status"] in KEPT_STATUS.values() else "failed"
        raise RunFailed(
            results["reason"] + (f"; result record: {record_path}" if to_file else ""), exit_code=code, word=word
        ) from None
    finally:
        shutil.rmtree(folder.path, ignore_errors=True)
    return 0


def _keep_failed_record(
    cfg: RunConfig,
    *,
    record_path: Path,
    folder: RunFolder,
    reason: str,
    record_from_progress: Callable[[Path], dict[str, Any]],
    kept: str | None = None,
) -> dict[str, Any]:
    """Make sure a record with a failed status exists (``kept``: the status of the failing rank's exit code, out of
    memory or diverged) whose reason is the launcher's ``reason`` (``failure_reason``: it names the ranks' own
    reasons); prints its table (rank 0 left it to this) and returns its results."""
    record = None
    if record_path.exists() and folder.finished():
        record = read_json(record_path)
    if record is None:
        record = record_from_progress(folder.progress)
    results = record["results"]
    if results["status"] in KEPT_STATUS.values():
        pass
    elif kept is not None:  # another rank ran out of memory or diverged; rank 0 only saw its peer vanish
        results["status"], results["reason"] = kept, reason
    else:  # the launcher's reason: the first failing rank's own, or what another rank said of it
        results["status"], results["reason"] = "error", reason
    if cfg.output:
        write_json(record_path, record)
        if cfg.output == STDOUT:
            write_json(STDOUT, record)
    print_result_table(record)
    return results
