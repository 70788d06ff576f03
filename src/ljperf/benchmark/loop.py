"""One rank of ``ljperf benchmark``: build the engine, train warm-up and timed steps, measure memory on an
untimed step, and (rank 0) write the record and print the table.

Run: ``ljperf benchmark --model torch/llama-tiny --steps 10 --output result.json`` (``--nproc-per-node 2`` starts
torchrun through ``benchmark.recovery.launch``; under a user's own torchrun each process is one rank).
Flow: flags → ``RunConfig`` → ``RunContext`` → recompute plan and memory check → engine → timed loop → record.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from ljperf.benchmark.data import SyntheticTokens
from ljperf.benchmark.faults import Fault
from ljperf.benchmark.memory_check import benchmark_forecast, check_memory
from ljperf.benchmark.profile import profile_steps
from ljperf.benchmark.progress import ProgressReporter
from ljperf.benchmark.record import LoopState, new_record, results_section, speed_section
from ljperf.benchmark.table import last_line, print_result_table
from ljperf.core import hardware
from ljperf.core.console import say, warn
from ljperf.core.errors import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    Diverged,
    UsageError,
    describe,
    failure,
    hold_interrupts,
    interrupt_on_signals,
    raise_if_interrupted,
    restore_signals,
)
from ljperf.core.gc_pause import resume_collection
from ljperf.core.phases import PhaseClock
from ljperf.core.records import write_json
from ljperf.distributed import memory
from ljperf.distributed.launch import RunFolder, launcher_gone
from ljperf.distributed.runtime import shutdown_process
from ljperf.engines import Engine, make_engine
from ljperf.models.spec import build_meta
from ljperf.recompute.closed_loop import close_the_loop
from ljperf.recompute.run import prepare_run
from ljperf.run.config import RunConfig
from ljperf.run.context import RunContext, init_process, unjoined


def run_worker(cfg: RunConfig, *, picture: Callable[..., None] | None = None) -> int:
    """One rank of a run: build, train, measure, and (on rank 0) print and write the record; ``picture``:
    ``--plot``'s drawing (``plan.plot.benchmark_picture`` with its path), called with the run and its record."""
    previous = interrupt_on_signals()
    run = unjoined(cfg)
    record: dict[str, Any] | None = None
    reporter: ProgressReporter | None = None
    state = LoopState()
    status, reason, exit_code = "ok", None, EXIT_OK
    try:
        init_process(run, need_group=cfg.engine != "torch")  # sets the rank first: a failure here still knows it
        record = new_record(cfg, run)
        reporter = ProgressReporter(run)
        state.recompute = prepare_run(run)
        state.forecast_made = check_memory(run, state.recompute.plan if state.recompute else None)
        engine = make_engine(run)
        engine.setup(build_meta(cfg.model, attn_implementation=cfg.train.attn_implementation))
        record["config"]["engine"] = engine.describe().record()
        resume_collection()  # start-up is over: imports, forecast, the built and sharded model
        train_loop(run, engine, state=state, reporter=reporter)
        hold_interrupts()
        raise_if_interrupted()
    except UsageError:
        raise
    except (Exception, KeyboardInterrupt) as exc:  # the record must be written whatever failed
        # First: a signal from here on (torchrun's SIGTERM after this rank's own error, a second Ctrl-C) must not
        # escape while the record is written. Only the microseconds before this line stay open to one.
        hold_interrupts()
        status, reason, exit_code = failure(exc)
        if (folder := RunFolder.watching()) is not None:
            folder.leave_failure(reason, rank=run.rank)
    finally:
        if reporter is not None:
            reporter.close()
    if record is None and exit_code in (EXIT_SIGINT, EXIT_SIGTERM):
        # Nothing ran, so nothing is lost; and an import the signal cut short is broken (retried, it warns or fails).
        print(f"ljperf benchmark: {reason} before the run began; no record written", file=sys.stderr)
        return exit_code
    if record is None:  # the process group failed to form
        record = new_record(cfg, run)
    if reporter is None:
        reporter = ProgressReporter(run)
    recompute = state.recompute
    rflops = recompute.recompute_flops_per_token if recompute else 0.0
    record["results"] = results_section(cfg, run, state, status=status, reason=reason, recompute_flops_per_token=rflops)
    if recompute is not None:
        loop = {"closed_loop": state.closed_loop} if state.closed_loop else {}
        record["results"]["recompute"] = recompute.record() | loop
    if run.is_main and (state.forecast_made or exit_code not in (EXIT_SIGINT, EXIT_SIGTERM)):
        # A failed run's record shows what the forecast expected too; a signal must not wait on a first trace.
        plan = recompute.plan if recompute is not None else None
        record["results"]["forecast"] = benchmark_forecast(run, record["results"], plan)
        if status == "ok":
            record["results"]["speed"] = speed_section(run, record["results"], plan)
    if run.is_main:
        if cfg.output:
            try:
                write_json(cfg.output, record)
            except OSError as exc:  # checked before the run, so the disk filled or the folder went since
                print(f"ljperf benchmark: the record could not be written to {cfg.output}: {exc}", file=sys.stderr)
                exit_code = exit_code or EXIT_ERROR
        reporter.finished(record)
        if status == "ok" or not reporter.watched:  # else ljperf's launcher prints it, with the failing rank's cause
            print_result_table(record)
        if picture is not None:
            _draw(picture, run, record, recompute)
        if reason is not None and not reporter.watched:  # failed
            interrupted = exit_code in (EXIT_SIGINT, EXIT_SIGTERM)
            print(last_line(reason, interrupted=interrupted, output=cfg.output, status=status), file=sys.stderr)
    if status == "ok" or run.world == 1:  # a failed group is kept: its barrier could wait on a lost peer
        shutdown_process()
    if (folder := RunFolder.watching()) is not None and launcher_gone():  # killed: nobody else removes it
        shutil.rmtree(folder.path, ignore_errors=True)
    restore_signals(previous)
    return exit_code


def _draw(picture: Callable[..., None], run: RunContext, record: dict[str, Any], recompute: Any) -> None:
    """``--plot``: the forecast over the step with the measured peak; a failure only warns."""
    try:
        budget = recompute.budget_bytes if recompute is not None else None
        picture(run=run, record=record, plan=recompute.plan if recompute else None, budget=budget)
    except Exception as exc:  # a picture must never fail a benchmark
        warn(f"no memory picture ({describe(exc)})")
        return
    say(f"memory picture: {run.config.explain.plot}")


def train_loop(run: RunContext, engine: Engine, *, state: LoopState, reporter: ProgressReporter) -> None:
    """Warm-up steps, then timed steps between device synchronisations; memory on an untimed step."""
    train = run.train
    device = run.device.torch_device
    data = SyntheticTokens(
        vocab=run.model.vocab,
        seq_len=train.resolved_seq_len,
        micro_batch=train.micro_batch,
        grad_accum=train.grad_accum,
        world=run.mesh.dp,  # a tensor-parallel group trains on one rank's share
        seed=train.seed,
    )
    # Step 1 creates the optimizer states, so memory is measured from step 2 on (the steady state).
    track_step = 1 if train.warmup >= 2 else train.warmup + train.steps
    total = train.warmup + train.steps + (1 if track_step >= train.warmup + train.steps else 0)
    measure_steps = {track_step}
    # The closed loop's plan must run the timed steps, and on CPU its first step is measured again before them;
    # compiled, a new plan's first step may recompile, so it stays out of the timing.
    loop_warmup = 2 if device.type == "cuda" and run.optim.compile_mode == "off" else 3
    solved = state.recompute is not None and state.recompute.budget_bytes is not None
    if solved and train.warmup < loop_warmup and run.is_main:
        say(f"closed loop off: it needs --warmup {loop_warmup} or more here; the solver's plan runs as forecast")
    if run.optim.compile_mode != "off" and run.is_main:  # the first step compiles: tens of seconds, silent
        say(f"compiling ({run.optim.compile_mode}) during the first warm-up step; inductor's cache makes it quicker")
    clock = PhaseClock(device_type=device.type)
    fault = Fault.from_env()
    try:
        _steps(
            run,
            engine,
            data,
            state,
            reporter,
            clock=clock,
            total=total,
            measure_steps=measure_steps,
            track_step=track_step,
            closed_loop=solved and train.warmup >= loop_warmup,
            fault=fault,
        )
        if run.config.explain.profile is not None:
            state.profile = profile_steps(run, engine, data, first=total, fault=fault)
    finally:  # a run that fails after its measured step (out of memory in a later one) keeps its peak
        if device.type == "cuda":
            with contextlib.suppress(RuntimeError):  # a broken CUDA context must not hide the run's own error
                state.memory = memory.cuda_stats(device)
        with contextlib.suppress(RuntimeError):  # CUDA: a step cut short left an event unrecorded
            state.phase_seconds = clock.seconds()


def _steps(
    run: RunContext,
    engine: Engine,
    data: SyntheticTokens,
    state: LoopState,
    reporter: ProgressReporter,
    *,
    clock: PhaseClock,
    total: int,
    measure_steps: set[int],
    track_step: int,
    closed_loop: bool,
    fault: Fault | None,
) -> None:
    train, device = run.train, run.device.torch_device
    for step in range(total):
        raise_if_interrupted()
        batches = data.micro_batches(step, run.dp_rank, device)
        if fault is not None:
            fault.maybe_fire(step, run.rank)
        elapsed, peaks = None, None
        if step in measure_steps:
            loss, stats = measured_memory_step(run, engine, batches)
            state.memory, peaks = stats, asdict(stats)
            if step == track_step and closed_loop:
                if loop := close_the_loop(run, engine.model, state.recompute, measured=stats.peak_allocated):
                    state.recompute, state.closed_loop = loop
                    # CUDA's counters were reset for the new plan; the CPU measures its first step if untimed
                    if state.closed_loop["replanned"] and device.type != "cuda":
                        measure_steps.add(step + 1)
        else:
            timed = train.warmup <= step < train.warmup + train.steps
            hardware.synchronize(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            with clock.step() if timed else contextlib.nullcontext():
                loss = engine.train_step(batches)
            hardware.synchronize(device)
            elapsed = time.perf_counter() - start
            if timed:
                state.step_times.append(elapsed)
                state.step_cpu_times.append(time.process_time() - cpu_start)
                state.losses.append(loss)
        if not math.isfinite(value := float(loss)):
            raise Diverged(f"the loss became {value} at step {step + 1}")
        timed_steps = (len(state.step_times), train.steps)
        reporter.step(step, timed=timed_steps, loss=loss, seconds=elapsed, peaks=peaks)


def measured_memory_step(
    run: RunContext, engine: Engine, batches: list[torch.Tensor]
) -> tuple[torch.Tensor, memory.MemoryStats]:
    """An untimed step whose peak memory is the run's figure (CPU: live tensors over the engine's state and the
    batch; CUDA: the allocator's); its loss and this rank's memory."""
    device = run.device.torch_device
    if device.type == "cuda":
        memory.reset_cuda_peak(device)
        loss = engine.train_step(batches)
        # Read again when the loop ends (a later step may go higher); this reading is the progress line's.
        return loss, memory.cuda_stats(device)
    with memory.LiveTensorBytes(engine.state_tensors() + batches) as tracker:
        loss = engine.train_step(batches)
    return loss, tracker.stats()
