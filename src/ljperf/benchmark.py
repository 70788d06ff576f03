"""``ljperf benchmark``: train a catalog model on synthetic tokens and measure it.

Run: ``ljperf benchmark --model torch/llama-tiny --steps 10 --output result.json``
(``--nproc-per-node 2`` starts torchrun; under a user's own torchrun each process is one rank).
Flow: CLI flags → ``BenchmarkConfig`` → engine build → timed loop → result record (docs/results.md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ljperf import config as cfgmod
from ljperf import deepspeed_config, hardware, memory, models
from ljperf.checkpoint import fixed_plan, parse_recompute
from ljperf.checkpoint.solver import close_the_loop, prepare_run
from ljperf.compile import DEEPCOMPILE_WARMUP
from ljperf.config import EngineConfig, LaunchConfig, OptimConfig, TrainConfig
from ljperf.data import SyntheticTokens
from ljperf.engines import make_engine
from ljperf.errors import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    UsageError,
    failure,
    hold_interrupts,
    interrupt_on_signals,
    raise_if_interrupted,
    restore_signals,
)
from ljperf.faults import Fault
from ljperf.forecast.bench import benchmark_forecast, check_memory
from ljperf.launch import RunFolder
from ljperf.metrics import Throughput, throughput
from ljperf.models import ModelSpec
from ljperf.report import ProgressReporter, print_result_table
from ljperf.result import check_writable, record_header, write_json
from ljperf.runtime import (
    Process,
    RunContext,
    check_process_count,
    init_process,
    local_world_size,
    resolve_device_type,
    resolve_train,
    shutdown_process,
    under_torchrun,
)


@dataclass(kw_only=True)
class BenchmarkConfig:
    """A whole benchmark run, resolved from the command line."""

    engine: str
    """torch, fsdp or deepspeed."""
    model: ModelSpec
    """The model to train."""
    train: TrainConfig
    """Batch, sequence, precision and steps."""
    launch: LaunchConfig
    """Processes, nodes and timeouts."""
    engine_opts: EngineConfig = field(default_factory=EngineConfig)
    """FSDP2 / DeepSpeed options."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizations (activation checkpoint, compile)."""
    deepspeed_user: dict = field(default_factory=dict)
    """The ``--deepspeed-config`` file as loaded (deepspeed engine; ``{}``: none)."""
    output: str | None = None
    """Where the JSON record goes (atomically), or None."""
    argv: list[str] = field(default_factory=list)
    """The command line, recorded in ``args``."""

    def __post_init__(self) -> None:
        engine, optim = self.engine, self.optim
        if optim.compile_mode == "deepspeed" and engine != "deepspeed":
            raise UsageError(
                f"--compile-mode deepspeed is DeepSpeed's engine.compile(): use deepspeed/{self.model.name}"
            )
        cfgmod.check_budget_flags(recompute=optim.recompute, memory_budget=optim.memory_budget)
        cfgmod.check_precision(self.train.precision, engine=engine)
        if (plan := parse_recompute(optim.recompute)) != "auto":
            fixed_plan(plan, self.model.layers)  # one that does not match the model fails here, not in every rank
        if optim.compile_mode != "off" and self.train.warmup < 1:
            raise UsageError("--compile needs --warmup 1 or more: the first steps compile (kept out of the step times)")


def _warmup(args: argparse.Namespace, *, device_type: str) -> int:
    """``--warmup``, or its default: DeepCompile (0.19) adds its prefetch passes at DeepSpeed's global step 5
    and compiles the model again (``deepspeed/compile/init_z3.py``), so steps 0-5 are its warm-up."""
    deepcompile = args.compile_mode == "deepspeed" and device_type == "cuda"
    if args.warmup is None:
        return DEEPCOMPILE_WARMUP if deepcompile else TrainConfig.warmup
    if deepcompile and args.warmup < DEEPCOMPILE_WARMUP and os.environ.get("RANK", "0") == "0":
        print(f"note: DeepCompile compiles again at step 5; --warmup {DEEPCOMPILE_WARMUP} keeps that out of the timing")
    return args.warmup


def config_from_args(args: argparse.Namespace, argv: list[str]) -> BenchmarkConfig:
    engine = models.engine_from_args(args)
    cfgmod.check_engine_flags(engine, zero_stage=args.zero_stage, reshard_after_forward=args.reshard_after_forward)
    user, flags = deepspeed_config.from_args(args, engine=engine)
    args.micro_batch, args.grad_accum, args.zero_stage = flags.micro_batch, flags.grad_accum, flags.zero_stage
    if args.compile and args.compile_mode not in (None, "regional"):
        raise UsageError(f"--compile is --compile-mode regional: it contradicts --compile-mode {args.compile_mode}")
    args.compile_mode = "regional" if args.compile else args.compile_mode or OptimConfig.compile_mode
    device_type = resolve_device_type(args.device)
    args.warmup = _warmup(args, device_type=device_type)
    train, launch = cfgmod.from_args(TrainConfig, args), cfgmod.from_args(LaunchConfig, args)
    engine_opts, optim = cfgmod.from_args(EngineConfig, args), cfgmod.from_args(OptimConfig, args)
    spec = models.spec_from_args(args)  # after the flags: reading the model takes seconds
    cfg = BenchmarkConfig(
        engine=engine,
        model=spec,
        train=train,
        launch=launch,
        engine_opts=engine_opts,
        optim=optim,
        deepspeed_user=user,
        output=args.output,
        argv=argv,
    )
    cfg.train = resolve_train(cfg.train, model=spec, device_type=device_type)
    check_process_count(cfg.launch, device_type)
    if cfg.output is not None and os.environ.get("GROUP_RANK", "0") == "0":
        # Rank 0's node writes it, under any launcher. All its ranks check: one blocked joining the group would
        # not see torchrun's SIGTERM, and would hold the run 30 s until its SIGKILL.
        check_writable(cfg.output)
    if engine == "deepspeed" and not under_torchrun():
        # A contradicting DeepSpeed config fails here (exit 2), before any process starts.
        from ljperf.engines.deepspeed_engine import resolved_config

        resolved_config(run_context(cfg, world=cfg.launch.nproc_per_node * cfg.launch.nnodes))
    return cfg


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf benchmark``."""
    cfg = config_from_args(args, argv)
    if cfg.launch.distributed and not under_torchrun():
        from ljperf.launch import launch

        return launch(cfg, record_from_progress=functools.partial(results_from_progress, cfg))
    return run_worker(cfg)


@dataclass
class LoopState:
    """What the loop has measured so far; kept when a run fails half-way."""

    losses: list[torch.Tensor] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    memory_method: str | None = None
    recompute: Any = None
    """The recompute plan running (``checkpoint.solver.Decision``; the closed loop may replace it)."""
    closed_loop: dict | None = None
    forecast_made: bool = False
    """The memory check forecast the recipe before the run: a record written after a signal (torchrun's SIGTERM
    once a peer failed, a Ctrl-C) keeps the forecast too, repeated from the trace cache in milliseconds."""


def run_worker(cfg: BenchmarkConfig) -> int:
    """One rank of a run: build, train, measure, and (on rank 0) print and write the record."""
    previous = interrupt_on_signals()
    run = run_context(cfg)
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
        engine.setup(models.build_meta(cfg.model, attn_implementation=cfg.train.attn_implementation))
        record["config"]["engine"] = engine.describe()
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
        record, reporter = new_record(cfg, run), ProgressReporter(run)
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
        if status != "ok" and not reporter.watched:
            print(f"ljperf benchmark: {status}: {reason}", file=sys.stderr)
    if status == "ok" or run.world == 1:  # a failed group is kept: its barrier could wait on a lost peer
        shutdown_process()
    restore_signals(previous)
    return exit_code


def run_context(cfg: BenchmarkConfig, *, world: int = 1) -> RunContext:
    """The run context of ``cfg`` before the process group is joined: rank 0 of ``world`` on an unnamed device."""
    device = hardware.DeviceInfo(type=resolve_device_type(cfg.train.device), index=None, name="unknown")
    return RunContext(
        engine=cfg.engine,
        model=cfg.model,
        train=cfg.train,
        launch=cfg.launch,
        engine_opts=cfg.engine_opts,
        optim=cfg.optim,
        deepspeed_user=cfg.deepspeed_user,
        process=Process(world=world, device=device),
    )


def new_record(cfg: BenchmarkConfig, run: RunContext) -> dict[str, Any]:
    spec = cfg.model
    train = cfg.train
    tokens_per_step = train.micro_batch * train.seq_len * train.grad_accum * run.world
    return {
        **record_header("benchmark", args=cfg.argv, devices=[run.device.name], world_size=run.world),
        "config": {
            "model": {
                "name": spec.name,
                "architecture": spec.architecture,
                "params": spec.params.total,
                "params_active": spec.params.active,
                "params_embedding": spec.params.embedding,
                "layers": spec.layers,
                "hidden": spec.hidden,
                "heads": spec.heads,
                "kv_heads": spec.kv_heads,
                "vocab": spec.vocab,
                "flops_per_token": spec.flops_per_token(train.seq_len),
            },
            "engine": {"name": cfg.engine},
            "train": asdict(train),
            "optimizations": asdict(cfg.optim),
            "launch": launch_record(cfg.launch, world=run.world),
            "tokens_per_step": tokens_per_step,
        },
    }


def launch_record(launch: LaunchConfig, *, world: int) -> dict[str, Any]:
    """The record's ``launch``: the flags, with the processes per node and nodes a user's torchrun started."""
    record = {**asdict(launch), "world_size": world}
    if under_torchrun():  # ljperf's launcher sets the same numbers; a user's torchrun did not pass them as flags
        local = local_world_size(world)
        record |= {"nproc_per_node": local, "nnodes": max(1, world // local)}
    return record


def train_loop(run: RunContext, engine: Any, *, state: LoopState, reporter: ProgressReporter) -> None:
    """Warm-up steps, then timed steps between device synchronisations; memory on an untimed step."""
    train = run.train
    device = run.device.torch_device
    data = SyntheticTokens(
        vocab=run.model.vocab,
        seq_len=train.seq_len,
        micro_batch=train.micro_batch,
        grad_accum=train.grad_accum,
        world=run.world,
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
        print(f"closed loop off: it needs --warmup {loop_warmup} or more here; the solver's plan runs as forecast")
    try:
        _steps(
            run,
            engine,
            data,
            state,
            reporter,
            total=total,
            measure_steps=measure_steps,
            track_step=track_step,
            closed_loop=solved and train.warmup >= loop_warmup,
            fault=Fault.from_env(),
        )
    finally:  # a run that fails after its measured step (out of memory in a later one) keeps its peak
        if device.type == "cuda":
            with contextlib.suppress(RuntimeError):  # a broken CUDA context must not hide the run's own error
                state.peak_allocated, state.peak_reserved = memory.cuda_peaks(device)


def _steps(
    run: RunContext,
    engine: Any,
    data: SyntheticTokens,
    state: LoopState,
    reporter: ProgressReporter,
    *,
    total: int,
    measure_steps: set[int],
    track_step: int,
    closed_loop: bool,
    fault: Fault | None,
) -> None:
    train, device = run.train, run.device.torch_device
    for step in range(total):
        raise_if_interrupted()
        batches = data.micro_batches(step, run.rank, device)
        if fault is not None:
            fault.maybe_fire(step, run.rank)
        elapsed = None
        if step in measure_steps:
            loss = measured_memory_step(run, engine, batches, state=state)
            if step == track_step and closed_loop:
                if loop := close_the_loop(run, engine.model, state.recompute, measured=state.peak_allocated):
                    state.recompute, state.closed_loop = loop
                    # CUDA's counters were reset for the new plan; the CPU measures its first step if untimed
                    if state.closed_loop["replanned"] and device.type != "cuda":
                        measure_steps.add(step + 1)
        else:
            hardware.synchronize(device)
            start = time.perf_counter()
            loss = engine.train_step(batches)
            hardware.synchronize(device)
            elapsed = time.perf_counter() - start
            if train.warmup <= step < train.warmup + train.steps:
                state.step_times.append(elapsed)
                state.losses.append(loss)
        peaks = None
        if step in measure_steps:
            peaks = {
                "peak_allocated": state.peak_allocated,
                "peak_reserved": state.peak_reserved,
                "memory_method": state.memory_method,
            }
        reporter.step(step, total=total, loss=loss, seconds=elapsed, peaks=peaks)


def measured_memory_step(
    run: RunContext, engine: Any, batches: list[torch.Tensor], *, state: LoopState
) -> torch.Tensor:
    """An untimed step whose peak memory is the run's figure (CPU: live tensors; CUDA: allocator)."""
    device = run.device.torch_device
    if device.type == "cuda":
        memory.reset_cuda_peak(device)
        state.memory_method = memory.CUDA_METHOD
        loss = engine.train_step(batches)
        # Read again when the loop ends (a later step may go higher); this reading is the progress line's.
        state.peak_allocated, state.peak_reserved = memory.cuda_peaks(device)
        return loss
    # An engine whose state lies outside model/optimizer.state (DeepSpeed's flat partitions) lists its own.
    own = getattr(engine, "state_tensors", None)
    alive = (own() if own else memory.training_state_tensors(engine.model, engine.optimizer)) + batches
    with memory.LiveTensorBytes(alive) as tracker:
        loss = engine.train_step(batches)
    state.peak_allocated = tracker.peak
    state.memory_method = memory.CPU_METHOD
    return loss


def results_section(
    cfg: BenchmarkConfig,
    run: RunContext,
    state: LoopState,
    *,
    status: str,
    reason: str | None,
    recompute_flops_per_token: float = 0.0,
) -> dict[str, Any]:
    """The ``results`` of the record; all ranks call it (it gathers when the run is healthy)."""
    healthy = status == "ok" and dist.is_initialized()
    losses = [float(x) for x in _mean_over_ranks(state.losses, healthy)]
    per_rank_alloc, per_rank_reserved = _per_rank_memory(run, state, healthy)
    out: dict[str, Any] = {
        "status": status,
        "reason": reason,
        "steps_completed": len(state.step_times),
        "losses": losses,
        "step_times_s": state.step_times,
        "peak_allocated_bytes": max((x for x in per_rank_alloc if x is not None), default=None),
        "peak_reserved_bytes": max((x for x in per_rank_reserved if x is not None), default=None),
        "peak_allocated_bytes_per_rank": per_rank_alloc,
        "peak_reserved_bytes_per_rank": per_rank_reserved,
        "memory_method": state.memory_method,
    }
    # A run that timed no step has every figure, each null (it lacked the mean, HFU and the peak used).
    figures: dict[str, Any] = dict.fromkeys([f.name for f in fields(Throughput)] + ["peak_tflops_per_device"])
    if state.step_times:
        train = cfg.train
        # The peak table holds dense bf16 figures: no MFU for fp32 or CPU unless --peak-tflops says.
        known = hardware.peak_tflops(run.device.name) if run.device.type == "cuda" and run.bf16 else None
        peak = train.peak_tflops or known
        figures = asdict(
            throughput(
                state.step_times,
                tokens_per_step=train.micro_batch * train.seq_len * train.grad_accum * run.world,
                world=run.world,
                flops_per_token=cfg.model.flops_per_token(train.seq_len),
                recompute_flops_per_token=recompute_flops_per_token,
                peak_tflops=peak,
            )
        ) | {"peak_tflops_per_device": peak}
    if cfg.optim.compile_mode != "off":
        from ljperf.compile import session

        out["compile"] = session().results() if session() else None
    return {**figures, **out}


def _mean_over_ranks(losses: list[torch.Tensor], healthy: bool) -> list[float]:
    if not losses:
        return []
    stacked = torch.stack(losses).float()
    if healthy and dist.get_world_size() > 1:
        dist.all_reduce(stacked)
        stacked /= dist.get_world_size()
    return stacked.tolist()


def _per_rank_memory(run: RunContext, state: LoopState, healthy: bool) -> tuple[list[int | None], list[int | None]]:
    """One entry per rank; a failed run knows only its own (the others are None)."""
    mine = (state.peak_allocated, state.peak_reserved)
    gathered: list[Any] = [None] * run.world
    if healthy and run.world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered[run.rank] = mine
    return [None if g is None else g[0] for g in gathered], [None if g is None else g[1] for g in gathered]


def results_from_progress(cfg: BenchmarkConfig, progress: Path) -> dict[str, Any]:
    """The record of a run whose rank 0 died before writing one: the steps and the peak its progress lines show."""
    run = run_context(cfg, world=cfg.launch.nproc_per_node * cfg.launch.nnodes)
    record = new_record(cfg, run)
    state = LoopState()
    lines = progress.read_text().splitlines() if progress.exists() else []
    for line in lines:
        entry = json.loads(line)
        step, seconds = entry.get("step"), entry.get("time_s")
        if step is not None and seconds is not None and cfg.train.warmup <= step < cfg.train.warmup + cfg.train.steps:
            state.step_times.append(seconds)
            state.losses.append(torch.tensor(entry["loss"]))
        if "peaks" in entry:  # the measured step's memory: rank 0's, the figure a record from its end would hold
            state.peak_allocated = entry["peaks"]["peak_allocated"]
            state.peak_reserved = entry["peaks"]["peak_reserved"]
            state.memory_method = entry["peaks"]["memory_method"]
    record["results"] = results_section(cfg, run, state, status="error", reason=None)
    return record
