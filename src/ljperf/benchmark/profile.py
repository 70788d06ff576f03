"""``ljperf benchmark --profile DIR``: after the timed steps, more steps under ``torch.profiler``, untimed, and
their trace per rank; on CUDA also a memory snapshot of one step.

Run: ``ljperf benchmark --model torch/llama-tiny --steps 5 --profile prof/`` writes ``prof/rank0.trace.json.gz``
(open it in https://ui.perfetto.dev or chrome://tracing); on CUDA ``prof/rank0.memory.pickle`` too (drag it into
https://pytorch.org/memory_viz). ``profile_steps(run, engine, data, first=N)`` is what the loop calls.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ljperf.benchmark.breakdown import from_trace
from ljperf.benchmark.data import SyntheticTokens
from ljperf.benchmark.faults import Fault
from ljperf.core import hardware
from ljperf.core.console import say, warn
from ljperf.core.phases import PhaseClock
from ljperf.run.context import RunContext

if TYPE_CHECKING:
    from ljperf.engines import Engine

PROFILED_STEPS = 2
"""Steps the trace holds."""
PROFILER_WARMUP = 1
"""Steps the profiler runs before it records (its own start-up, CUPTI's on CUDA, stays out of the trace)."""
MEMORY_HISTORY_ENTRIES = 1_000_000
"""Allocator events a CUDA memory snapshot keeps (the last ones; a step of a large model makes about 10^5)."""


def trace_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.trace.json.gz"


def snapshot_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.memory.pickle"


def profile_steps(
    run: RunContext, engine: Engine, data: SyntheticTokens, *, first: int, fault: Fault | None = None
) -> dict[str, Any]:
    """Profile ``PROFILER_WARMUP + PROFILED_STEPS`` steps from step ``first`` on, write this rank's trace, and on
    CUDA snapshot the allocator over one more step. Returns this rank's ``results.profile`` (``record``), the
    profiled steps' seconds by part (``steps``, ``from_trace``) and the files it wrote (``written``). A file that
    cannot be written (a full disk) leaves no part of itself: the measured run stands, ``record.error`` says why
    and ``steps`` is None (the breakdown then comes from the timers)."""
    explain, device = run.config.explain, run.device.torch_device
    if (folder := explain.profile) is None:
        raise ValueError("profile_steps profiles into --profile DIR: none was given")
    if run.is_main:
        say(f"profiling {PROFILED_STEPS} more steps into {folder}")
    written: dict[str, list[str]] = {"traces": [], "memory_snapshots": []}
    record: dict[str, Any] = {"steps": PROFILED_STEPS, "with_stack": explain.profile_with_stack}
    try:
        trace = trace_path(folder, run.rank)
        wall = _traced_steps(run, engine, data, first=first, into=trace, fault=fault)
        written["traces"].append(str(trace))
        with gzip.open(trace, "rt") as f:
            steps = from_trace(json.load(f)["traceEvents"], device_type=device.type)
        record["step_times_s"] = wall
        if device.type == "cuda":
            batches = data.micro_batches(first + PROFILER_WARMUP + PROFILED_STEPS, run.dp_rank, device)
            snapshot = snapshot_path(folder, run.rank)
            memory_snapshot(engine, batches, path=snapshot, device=device)
            written["memory_snapshots"].append(str(snapshot))
    except OSError as exc:
        warn(f"rank {run.rank}: the profile could not be written ({exc.strerror or exc}); the timed results stand")
        return {"record": {**record, "error": f"{type(exc).__name__}: {exc.strerror or exc}"}, "steps": None,
                "written": written}  # fmt: skip
    return {"record": record, "steps": steps, "written": written}


def _traced_steps(
    run: RunContext, engine: Engine, data: SyntheticTokens, *, first: int, into: Path, fault: Fault | None
) -> list[float]:
    """The profiled steps' wall seconds; their trace (CPU activities, CUDA's too on a GPU, shapes; stacks with
    ``--profile-with-stack``) goes to a hidden file in the folder, renamed to ``into`` once whole. ``fault``
    (``LJPERF_FAULT``) fires in them as in the timed steps: its step counts on from theirs."""
    explain, device = run.config.explain, run.device.torch_device
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    partial = into.with_name(f".{into.name.removesuffix('.trace.json.gz')}.partial.trace.json.gz")
    clock = PhaseClock(device_type=device.type, annotate=True, timed=False)
    wall: list[float] = []
    try:
        with torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=PROFILER_WARMUP, active=PROFILED_STEPS, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(str(partial)),
            record_shapes=True,
            with_stack=explain.profile_with_stack,
        ) as prof:
            for i in range(PROFILER_WARMUP + PROFILED_STEPS):
                batches = data.micro_batches(first + i, run.dp_rank, device)
                if fault is not None:
                    fault.maybe_fire(first + i, run.rank)
                hardware.synchronize(device)
                start = time.perf_counter()
                with clock.step():
                    engine.train_step(batches)
                    hardware.synchronize(device)  # inside the step's range: on CUDA it then holds the step's kernels
                if i >= PROFILER_WARMUP:
                    wall.append(time.perf_counter() - start)
                prof.step()
        os.replace(partial, into)
    finally:
        partial.unlink(missing_ok=True)
    return wall


def memory_snapshot(engine: Engine, batches: list[torch.Tensor], *, path: Path, device: torch.device) -> None:
    """The CUDA caching allocator's history over one step, as ``torch.cuda.memory._dump_snapshot`` writes it
    (into a hidden file of the folder, renamed to ``path`` once whole)."""
    partial = path.with_name(f".{path.name}.partial")
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
    try:
        engine.train_step(batches)
        hardware.synchronize(device)
        torch.cuda.memory._dump_snapshot(str(partial))
        os.replace(partial, path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        partial.unlink(missing_ok=True)
