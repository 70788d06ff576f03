"""What torch.compile does with a model, and what it buys (``ljperf compile-report``).

Run: ``ljperf compile-report --model torch/llama-tiny --seq-lens 512,1000,2048 [--output r.json]``
One process: graph breaks with their reasons and source lines (``torch._dynamo.explain`` of the whole forward),
then the same model compiled in place (``ljperf.compile``) and ``--repeats`` rounds of eager then compiled steps at
each length, interleaved: compile time per region, recompiles with the guard that failed, eager vs compiled step
time (the median of each round's median, min–max over the rounds; a speedup whose ranges overlap is marked ``≈``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from rich.markup import escape

from ljperf.benchmark.data import SyntheticTokens
from ljperf.compile.regional import compile_model
from ljperf.core import hardware
from ljperf.core.choices import TorchCompileMode
from ljperf.core.console import console, titled_table
from ljperf.core.errors import Interrupted, hold_interrupts, interrupt_on_signals, raise_if_interrupted, restore_signals
from ljperf.core.records import record_header
from ljperf.core.spread import OVERLAP_NOTE, Spread, format_ratio, format_spread, ratio
from ljperf.engines.torch_engine import TorchEngine
from ljperf.models.spec import build_meta
from ljperf.run.context import RunContext


def compile_report(
    run: RunContext,
    lengths: list[int],
    *,
    mode: TorchCompileMode,
    repeats: int,
    config: dict[str, Any],
    argv: list[str],
) -> dict[str, Any]:
    """Explain, compile in place (``mode``: regional or whole), then ``repeats`` rounds that time eager and compiled
    steps at each of ``lengths``, interleaved (eager under ``torch.compiler.set_stance("force_eager")``) so machine
    drift hits both alike; returns the report record, whose ``config`` is ``config`` (the flags as given) with the
    precision that ran."""
    header = record_header("compile-report", args=argv, devices=[run.device.name], world_size=1)
    engine = TorchEngine(run)
    engine.setup(build_meta(run.model, attn_implementation=run.train.attn_implementation))
    model = engine.model
    device, steps = run.device.torch_device, run.train.steps
    batches = {seq: _batches(run, seq) for seq in lengths}

    explained = explain_breaks(model, batches[lengths[0]][0], run)
    session = compile_model(model, mode)
    eager: dict[int, list[float]] = {seq: [] for seq in lengths}
    compiled: dict[int, list[float]] = {seq: [] for seq in lengths}
    compile_s = dict.fromkeys(lengths, 0.0)
    recompiles: dict[int, list[str]] = {seq: [] for seq in lengths}
    status, reason, previous = "ok", None, interrupt_on_signals()
    try:
        for _ in range(repeats):
            for seq in lengths:
                raise_if_interrupted()
                with torch.compiler.set_stance("force_eager"):
                    eager_s = _timed_steps(engine, batches[seq], steps=steps, device=device)
                before_time = sum(session.region_time_s.values())
                before_recompiles = len(session.recompile_reasons)
                compiled_s = _timed_steps(engine, batches[seq], steps=steps, device=device)
                eager[seq].append(eager_s)  # a length's round counts once both halves ran
                compiled[seq].append(compiled_s)
                compile_s[seq] += sum(session.region_time_s.values()) - before_time
                recompiles[seq] += session.recompile_reasons[before_recompiles:]
        hold_interrupts()
        raise_if_interrupted()
    except Interrupted as exc:  # SIGTERM or Ctrl-C: the rounds measured before it are kept
        hold_interrupts()
        status, reason = "interrupted", str(exc)
    finally:
        restore_signals(previous)
    rows = [
        length_row(seq, eager[seq], compiled[seq], compile_s=compile_s[seq], recompiles=recompiles[seq])
        for seq in lengths
        if eager[seq]
    ]
    return {
        **header,
        "config": {"model": run.model.name, **config, "precision": run.train.precision},
        "status": status,
        "reason": reason,
        "graph_breaks": explained,
        "lengths": rows,
        "compile": session.results(),
    }


def length_row(
    seq: int, eager: list[float], compiled: list[float], *, compile_s: float, recompiles: list[str]
) -> dict[str, Any]:
    """One length's row of the record: each repeat's median step time, eager and compiled, their medians, and the
    speedup of the medians with ``overlap`` set where the two min–max ranges overlap (``core.spread``)."""
    speedup = ratio(Spread.of(eager), Spread.of(compiled), reference="compiled")
    return {
        "seq_len": seq,
        "eager_step_s": statistics.median(eager),
        "compiled_step_s": statistics.median(compiled),
        "eager_step_s_repeats": eager,
        "compiled_step_s_repeats": compiled,
        "speedup": speedup.value if speedup else None,
        "overlap": bool(speedup and speedup.overlaps),
        "compile_s": round(compile_s, 3),
        "recompiles": recompiles,
    }


def _batches(run: RunContext, seq: int) -> list[torch.Tensor]:
    data = SyntheticTokens(
        vocab=run.model.vocab,
        seq_len=seq,
        micro_batch=run.train.micro_batch,
        grad_accum=1,
        world=1,
        seed=run.train.seed,
    )
    return data.micro_batches(0, 0, run.device.torch_device)


def _timed_steps(engine: TorchEngine, batches: list[torch.Tensor], *, steps: int, device: torch.device) -> float:
    """Median seconds of ``steps`` training steps, after one untimed step (which compiles)."""
    engine.train_step(batches)
    times = []
    for _ in range(steps):
        hardware.synchronize(device)
        start = time.perf_counter()
        engine.train_step(batches)
        hardware.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def explain_breaks(model: torch.nn.Module, tokens: torch.Tensor, run: RunContext) -> dict[str, Any]:
    """Graph breaks of the whole forward (a region's breaks are among them), with their source lines."""
    with run.autocast():
        out = torch._dynamo.explain(model)(input_ids=tokens, labels=tokens, use_cache=False)
    torch._dynamo.reset()  # explain's cache entries must not count as the compiled run's recompiles
    reasons = []
    for br in out.break_reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame else None
        reasons.append({"reason": br.reason.strip().splitlines()[0], "where": where, "line": frame and frame.line})
    return {"count": out.graph_break_count, "graphs": out.graph_count, "reasons": reasons}


def print_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    repeats = cfg.get("repeats", 1)
    title = f"compile-report · {cfg['model']} · {cfg['compile_mode']} · {cfg['precision']} · {repeats} repeat(s)"
    overlapping = any(row.get("overlap") for row in report["lengths"])
    table = titled_table(title, caption=OVERLAP_NOTE if overlapping else None)
    columns = ("seq len", "eager step", "min–max", "compiled step", "min–max", "speedup", "compile time", "recompiles")
    for col in columns:
        table.add_column(col, justify="right")
    table.add_row("", "ms", "ms", "ms", "ms", "×", "s", "")
    for row in report["lengths"]:
        eager = Spread.of(row.get("eager_step_s_repeats") or [row["eager_step_s"]])
        compiled = Spread.of(row.get("compiled_step_s_repeats") or [row["compiled_step_s"]])
        table.add_row(
            str(row["seq_len"]),
            *format_spread(eager, 1e3, ".1f"),
            *format_spread(compiled, 1e3, ".1f"),
            format_ratio(ratio(eager, compiled, reference="compiled")),
            f"{row['compile_s']:.1f}",
            str(len(row["recompiles"])),
        )
    console.print(table)
    comp = report["compile"]
    per_region = ", ".join(f"{name} {sec:.1f} s" for name, sec in comp["time_s_per_region"].items()) or "-"
    console.print(f"compile time per region: {per_region} (total {comp['time_s']:.1f} s)")
    breaks = report["graph_breaks"]
    console.print(f"graph breaks (whole forward): {breaks['count']} in {breaks['graphs']} graph(s)")
    for br in breaks["reasons"]:
        console.print(escape(f"  - {br['reason']}  at {br['where']}" + (f": {br['line']}" if br["line"] else "")))
    for row in report["lengths"]:
        for reason in row["recompiles"]:
            console.print(escape(f"recompile at seq {row['seq_len']}: {reason}"))
    for fb in comp["fallbacks"]:
        console.print(f"[yellow]eager fallback:[/] {escape(fb['region'])}: {escape(fb['reason'])}")
