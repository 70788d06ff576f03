"""What torch.compile does with a model, and what it buys (``ljperf compile-report``).

Run: ``ljperf compile-report --model torch/llama-tiny --seq-lens 512,1000,2048 [--output r.json]``
One process: graph breaks with their reasons and source lines (``torch._dynamo.explain`` of the whole forward),
then eager steps at each length, then the same model compiled in place (``ljperf.compile``) at each length:
compile time per region, recompiles with the guard that failed, eager vs compiled step time (medians).
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
from ljperf.core.console import console, titled_table
from ljperf.core.records import record_header
from ljperf.engines.torch_engine import TorchEngine
from ljperf.models.spec import build_meta
from ljperf.run.context import RunContext


def compile_report(
    run: RunContext, lengths: list[int], *, mode: str, config: dict[str, Any], argv: list[str]
) -> dict[str, Any]:
    """Explain, time eager, compile in place (``mode``: regional or whole), time compiled at each of ``lengths``;
    returns the report record, whose ``config`` is ``config`` (the flags as given) with the precision that ran."""
    header = record_header("compile-report", args=argv, devices=[run.device.name], world_size=1)
    engine = TorchEngine(run)
    engine.setup(build_meta(run.model, attn_implementation=run.train.attn_implementation))
    model = engine.model
    device, steps = run.device.torch_device, run.train.steps
    batches = {seq: _batches(run, seq) for seq in lengths}

    explained = explain_breaks(model, batches[lengths[0]][0], run)
    eager = {seq: _timed_steps(engine, batches[seq], steps=steps, device=device) for seq in lengths}

    session = compile_model(model, mode)
    rows = []
    for seq in lengths:
        before_time = sum(session.region_time_s.values())
        before_recompiles = len(session.recompile_reasons)
        compiled = _timed_steps(engine, batches[seq], steps=steps, device=device)
        rows.append(
            {
                "seq_len": seq,
                "eager_step_s": eager[seq],
                "compiled_step_s": compiled,
                "speedup": eager[seq] / compiled if compiled else None,
                "compile_s": round(sum(session.region_time_s.values()) - before_time, 3),
                "recompiles": session.recompile_reasons[before_recompiles:],
            }
        )
    return {
        **header,
        "config": {"model": run.model.name, **config, "precision": run.train.precision},
        "graph_breaks": explained,
        "lengths": rows,
        "compile": session.results(),
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
    table = titled_table(f"compile-report · {cfg['model']} · {cfg['compile_mode']} · {cfg['precision']}")
    for col in ("seq len", "eager step", "compiled step", "speedup", "compile time", "recompiles"):
        table.add_column(col, justify="right")
    table.add_row("", "ms", "ms", "×", "s", "")
    for row in report["lengths"]:
        table.add_row(
            str(row["seq_len"]),
            f"{row['eager_step_s'] * 1e3:.1f}",
            f"{row['compiled_step_s'] * 1e3:.1f}",
            f"{row['speedup']:.2f}",
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
