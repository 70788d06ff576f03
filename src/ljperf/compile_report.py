"""``ljperf compile-report``: what torch.compile does with a model, and what it buys.

Run: ``ljperf compile-report --model torch/llama-tiny --seq-lens 512,1000,2048 [--output r.json]``
One process: graph breaks with their reasons and source lines (``torch._dynamo.explain`` of the whole forward),
then eager steps at each length, then the same model compiled in place (``ljperf.compile``) at each length:
compile time per region, recompiles with the guard that failed, eager vs compiled step time (medians).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch
from rich.markup import escape

from ljperf import config as cfgmod
from ljperf import hardware, models
from ljperf.compile import compile_model
from ljperf.compile_report_flags import ReportConfig
from ljperf.config import LaunchConfig, TrainConfig
from ljperf.data import SyntheticTokens
from ljperf.engines.torch_engine import TorchEngine
from ljperf.errors import UsageError
from ljperf.report import console, titled_table
from ljperf.result import check_writable, record_header, write_json
from ljperf.runtime import Process, RunContext, init_process, resolve_device_type, resolve_train


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``ljperf compile-report``."""
    engine_name, spec = models.model_from_args(args)
    if engine_name != "torch":
        raise UsageError(f"compile-report runs one process: use --model torch/{spec.name} (regions are the same)")
    cfg = cfgmod.from_args(ReportConfig, args)
    if args.output is not None:
        check_writable(args.output)
    device_type = resolve_device_type(cfg.device)
    train = TrainConfig(
        micro_batch=cfg.micro_batch, seq_len=max(cfg.lengths), device=cfg.device, precision=cfg.precision
    )
    run_ctx = RunContext(
        engine="torch",
        model=spec,
        train=resolve_train(train, model=spec, device_type=device_type, seq_flag="--seq-lens"),
        launch=LaunchConfig(),
        process=Process(device=hardware.local_device(device_type, 0)),
    )
    run_ctx = init_process(run_ctx, need_group=False)
    report = compile_report(run_ctx, cfg, argv=argv)
    print_report(report)
    if args.output:
        write_json(args.output, report)
    return 0


def compile_report(run: RunContext, cfg: ReportConfig, *, argv: list[str]) -> dict[str, Any]:
    """Explain, time eager, compile in place, time compiled; returns the report record."""
    header = record_header("compile-report", args=argv, devices=[run.device.name], world_size=1)
    engine = TorchEngine(run)
    engine.setup(models.build_meta(run.model, attn_implementation=run.train.attn_implementation))
    model = engine.model
    device = run.device.torch_device
    batches = {seq: _batches(run, seq) for seq in cfg.lengths}

    explained = explain_breaks(model, batches[cfg.lengths[0]][0], run)
    eager = {seq: _timed_steps(engine, batches[seq], steps=cfg.steps, device=device) for seq in cfg.lengths}

    session = compile_model(model, cfg.compile_mode)
    lengths = []
    for seq in cfg.lengths:
        before_time = sum(session.region_time_s.values())
        before_recompiles = len(session.recompile_reasons)
        compiled = _timed_steps(engine, batches[seq], steps=cfg.steps, device=device)
        lengths.append(
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
        "config": {"model": run.model.name, **asdict(cfg), "precision": run.train.precision},
        "graph_breaks": explained,
        "lengths": lengths,
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
