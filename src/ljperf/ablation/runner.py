"""Run an ablation plan: one fresh ``ljperf benchmark`` process per run, interleaved across repeats.

Each run writes ``runs/<env>/<variant>.r<k>.json`` (the benchmark's record plus an ``ablation`` section)
only after it has ended, so a killed run never looks finished; with the same folder a re-run skips
finished runs. Each run gets its own compile cache folder, so no variant inherits another's compiled code.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

from ljperf.ablation.variants import Environment, Variant
from ljperf.core.console import console, warn
from ljperf.core.errors import UsageError, interrupt_on_signals, interrupts_held, restore_signals
from ljperf.core.record_check import record_problem
from ljperf.core.records import SCHEMA_VERSION, now_iso, read_json, write_json
from ljperf.core.switches import HOOKS
from ljperf.distributed.launch import RUN_DIR_ENV, end_with_parent

# Seconds a timed-out run gets after SIGTERM to write its partial record before SIGKILL.
STOP_GRACE_S = 15.0


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """One benchmark process of the plan."""

    environment: Environment
    environment_index: int
    variant: Variant
    variant_index: int
    repeat: int
    command: tuple[str, ...]
    """The ``ljperf benchmark`` flags: the shared ones, then the variant's."""

    @property
    def name(self) -> str:
        return f"{self.environment.name}/{self.variant.name}.r{self.repeat}"

    def path(self, out: Path) -> Path:
        return out / "runs" / self.environment.name / f"{self.variant.name}.r{self.repeat}.json"

    def meta(self) -> dict[str, Any]:
        """The ``ablation`` section of the run's record (what resume compares, what the report groups by)."""
        return {
            "variant": self.variant.name,
            "variant_index": self.variant_index,
            "flags": self.variant.text,
            "repeat": self.repeat,
            "environment": self.environment.describe(),
            "environment_index": self.environment_index,
            "command": list(self.command),
        }


def plan(
    *, shared: list[str], variants: list[Variant], environments: list[Environment], repeat: int
) -> list[PlannedRun]:
    """Every run, interleaved (A B C A B C …) so that drift of the machine hits all variants alike."""
    return [
        PlannedRun(
            environment=env,
            environment_index=e,
            variant=variant,
            variant_index=v,
            repeat=k,
            command=(*shared, *variant.flags),
        )
        for k in range(1, repeat + 1)
        for e, env in enumerate(environments)
        for v, variant in enumerate(variants)
    ]


def run_all(runs: list[PlannedRun], *, out: Path, timeout: float, force: bool) -> list[dict[str, Any]]:
    """Execute the plan (skipping finished runs unless ``force``); returns the records in plan order.

    Runs in ``out`` of another command (other flags, interpreter, variants or repeats) are refused, or deleted
    with ``force``: the folder then holds this command's runs only, and ``ljperf report`` shows what this did.
    """
    planned = {run.path(out): run for run in runs}
    existing, skipped = read_records(out)
    for problem in skipped:  # as unfinished: run again
        warn(f"skipping {problem}")
    stale = [path for path, rec in existing.items() if path not in planned or not same_run(rec, planned[path])]
    if stale and not force:
        raise UsageError(
            f"{stale[0]} is a run of another ablation ({_describe(existing[stale[0]], planned.get(stale[0]))}); "
            "pass --force to delete the other runs and re-run this one, or choose another --out"
        )
    for path in stale:
        path.unlink()
        path.with_suffix(".log").unlink(missing_ok=True)
    if stale:
        console.print(f"--force: deleted {len(stale)} run(s) of another ablation from {escape(str(out))}")
    done = [None] * len(runs) if force else [finished(run, existing.get(run.path(out)), out) for run in runs]
    todo = [i for i, record in enumerate(done) if record is None]
    if len(todo) < len(runs):
        console.print(f"resuming {out}: {len(runs) - len(todo)} of {len(runs)} runs already finished")
    records = []
    # SIGTERM (a scheduler ending the job) unwinds like Ctrl-C: the running benchmark is stopped, not orphaned,
    # and ljperf exits 143 (130).
    previous = interrupt_on_signals()
    try:
        for i, run in enumerate(runs):
            record = done[i]
            if record is None:
                step = f"[{todo.index(i) + 1}/{len(todo)}] {run.name}"
                with console.status(escape(f"{step}: {shlex.join(run.command)}")):
                    record = execute(run, out=out, timeout=timeout)
                console.print(f"{escape(step)}: {_one_line(record)}")
            records.append(record)
    finally:
        restore_signals(previous)
    return records


def read_records(out: Path) -> tuple[dict[Path, dict[str, Any]], list[str]]:
    """The run records in ``out`` by path (pending files of unfinished runs start with a dot, and are not read),
    and ``PATH: why`` for each file that is not one: damaged or edited outside ljperf, which writes atomically."""
    records: dict[Path, dict[str, Any]] = {}
    skipped: list[str] = []
    for path in sorted(p for p in out.glob("runs/*/*.json") if not p.name.startswith(".")):
        try:
            record = read_json(path)
            problem = _missing(record) or record_problem(record)
        except (OSError, ValueError) as exc:
            skipped.append(f"{path}: unreadable: {exc}")
            continue
        if problem is None:
            records[path] = record
        else:
            skipped.append(f"{path}: {problem}")
    return records, skipped


# What resume and the report read from a record (dotted path: type): a record edited by hand that lacks one is
# skipped like a damaged file, not a traceback in the report.
_REQUIRED: dict[str, type] = {
    "ablation.variant": str,
    "ablation.variant_index": int,
    "ablation.flags": str,
    "ablation.repeat": int,
    "ablation.environment.name": str,
    "ablation.environment.python": str,
    "ablation.environment.versions": dict,
    "ablation.environment_index": int,
    "ablation.command": list,
    "ablation.wall_s": numbers.Real,
    "ablation.log": str,
    "results.status": str,
}
# Read where present (a failed run has no figures, a crash record no config).
_OPTIONAL: dict[str, type] = {
    "results.tokens_per_s": numbers.Real,
    "results.step_time_s_p50": numbers.Real,
    "results.peak_allocated_bytes": numbers.Real,
    "results.mfu": numbers.Real,
    "results.losses": list,
    "start_time": str,
    "env": dict,
    "config": dict,
}
# The shared settings the report's title shows, read from every record that has a config.
_CONFIG = (
    "engine.name",
    "model.name",
    "launch.world_size",
    *(f"train.{key}" for key in ("micro_batch", "seq_len", "grad_accum", "precision", "steps", "warmup")),
)


def _missing(record: Any) -> str | None:
    """What ``record`` lacks of a run record, or None."""
    for path, kind in _REQUIRED.items():
        if not _is(_get(record, path), kind):
            return f"no valid {path}"
    for path, kind in _OPTIONAL.items():
        if _get(record, path) is not None and not _is(_get(record, path), kind):
            return f"{path} is not a {kind.__name__}"
    if not all(isinstance(arg, str) for arg in record["ablation"]["command"]):
        return "ablation.command is not a list of strings"
    if not all(_is(loss, numbers.Real) for loss in record["results"].get("losses") or []):
        return "results.losses is not a list of numbers"
    missing = [path for path in _CONFIG if record.get("config") and _get(record["config"], path) is None]
    return f"no config.{missing[0]}" if missing else None


def _get(record: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(record, dict):
            return None
        record = record.get(key)
    return record


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)


def normalized(command: list[str] | tuple[str, ...]) -> list[list[str]]:
    """``command``'s flags, each with its values, ``--x=y`` split, sorted: the same settings however written.

    The sort is stable, so a flag given twice (the last one wins) keeps its order, ``--no-x`` included."""
    groups: list[list[str]] = []
    for arg in command:
        flag = arg.startswith("-") and not _is_number(arg)
        if not flag and groups:
            groups[-1].append(arg)
        elif arg.startswith("--") and "=" in arg:
            groups.append(arg.split("=", 1))
        else:
            groups.append([arg])
    return sorted(groups, key=lambda group: group[0].removeprefix("--no-").lstrip("-"))


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def same_run(record: dict[str, Any], run: PlannedRun) -> bool:
    """Whether ``record`` is a run of ``run``'s benchmark command under the same interpreter."""
    meta = record["ablation"]
    return normalized(meta["command"]) == normalized(run.command) and (
        meta["environment"]["python"] == run.environment.python
    )


def _describe(record: dict[str, Any], run: PlannedRun | None) -> str:
    meta = record["ablation"]
    if run is None:
        return f"{meta['environment']['name']}/{meta['variant']}.r{meta['repeat']}: not among this command's runs"
    if normalized(meta["command"]) != normalized(run.command):
        return shlex.join(meta["command"])
    return f"under {meta['environment']['python']}"


def finished(run: PlannedRun, record: dict[str, Any] | None, out: Path) -> dict[str, Any] | None:
    """``run``'s record from an earlier invocation (None: run it), placed in this plan (variants may be reordered)."""
    if record is not None and (
        record["ablation"]["variant_index"] != run.variant_index
        or record["ablation"]["environment_index"] != run.environment_index
    ):
        record["ablation"] = {**record["ablation"], **run.meta()}
        write_json(run.path(out), record)
    return record


def execute(run: PlannedRun, *, out: Path, timeout: float) -> dict[str, Any]:
    """Run one benchmark process; its record (or one made here for a crash or timeout) is written at the end."""
    path = run.path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    pending = path.with_name(f".{path.stem}.pending.json")
    pending.unlink(missing_ok=True)
    log = path.with_suffix(".log")
    argv = [run.environment.python, "-m", "ljperf", "benchmark", *run.command, "--output", str(pending)]
    timed_out = False
    start = time.monotonic()
    # The run's own compile cache, in --out: a killed ablation leaves it there (not in $TMPDIR), and the run's
    # next start removes it.
    cache = path.with_name(f".{path.stem}.compile-cache")
    shutil.rmtree(cache, ignore_errors=True)
    with open(log, "w") as log_file:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache)}
        env.pop(RUN_DIR_ENV, None)
        for variable in HOOKS:  # a variant is its flags: CHECKPOINT_OPTIMIZATION would make each auto
            env.pop(variable, None)
        proc = None
        try:
            # A session of its own: a timeout or Ctrl-C stops the whole tree (torchrun and its ranks).
            with interrupts_held():
                proc = subprocess.Popen(
                    argv,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=end_with_parent,
                )
            exit_code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            assert proc is not None  # only its wait times out
            timed_out = True
            exit_code = _stop(proc)
        except BaseException:
            if proc is not None:
                _stop(proc)
            pending.unlink(missing_ok=True)
            raise
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    wall_s = time.monotonic() - start
    record = read_json(pending) if pending.exists() else _crash_record(run)
    results = record["results"]
    if timed_out:
        results["status"], results["reason"] = "timeout", f"stopped after --run-timeout {timeout:g} s"
    elif not pending.exists():
        results["reason"] = _last_line(log) or f"exited with code {exit_code}"
    record["ablation"] = {**run.meta(), "exit_code": exit_code, "wall_s": wall_s, "log": log.name}
    write_json(path, record)
    pending.unlink(missing_ok=True)
    return record


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM the run's process group (the benchmark keeps a partial record), SIGKILL after a grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _crash_record(run: PlannedRun) -> dict[str, Any]:
    """The record of a run that ended without writing one (crash, usage error, timeout before start-up): not a
    benchmark record (it has no config or figures), so of a kind of its own."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "ablation-run",
        "start_time": now_iso(),
        "args": ["benchmark", *run.command],
        "env": {"versions": run.environment.versions},
        "results": {"status": "error", "reason": None},
    }


def _last_line(log: Path) -> str | None:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else None


def _one_line(record: dict[str, Any]) -> str:
    res = record["results"]
    wall = f"{record['ablation']['wall_s']:.1f} s"
    if res["status"] != "ok":
        return f"[red]{res['status']}[/red] ({escape(str(res.get('reason')))}) · {wall}"
    return f"ok · {res['tokens_per_s']:,.0f} tokens/s · step {res['step_time_s_p50'] * 1e3:.1f} ms · {wall}"
