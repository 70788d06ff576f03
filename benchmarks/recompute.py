"""Run: ``.venv/bin/python benchmarks/recompute.py --model llama-tiny --micro-batch 4 --seq-len 1024``
(GPU: ``.venv/bin/python benchmarks/recompute.py --device cuda --model llama3.2-1b --micro-batch 4 --seq-len 4096``).

The auto recompute plan against every "first K layers full" plan (K = 0..L), side by side, under a budget
where no recompute does not fit (default: half-way between the forecasts of no and of full recompute).
Every plan is a real ``ljperf benchmark`` run in its own process; rounds are interleaved and each plan keeps
its best median step time. Prints the table, auto's ratio to the best fitting K and to full recompute, and
writes it to ``benchmarks/results/recompute_<model>_<device>_<date>.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ljperf.core import hardware
from ljperf.core.plans import summary
from ljperf.core.records import write_atomic
from ljperf.core.units import format_bytes, parse_size
from ljperf.forecast import Forecast, Recipe, forecast
from ljperf.models.spec import resolve
from ljperf.recompute.solver import Rates, allocated_budget, solve_recipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--budget", help="memory budget, e.g. 60MiB (default: half-way between none and full)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repeats of every plan")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of every benchmark process (default: 1)")
    parser.add_argument(
        "--ks", help="comma-separated K to run (default: every K = 0..L; a subset on a short GPU lease)"
    )
    parser.add_argument(
        "--out", help="markdown file (default: benchmarks/results/recompute_<model>_<device>_<date>.md)"
    )
    args = parser.parse_args()

    spec = resolve(name=args.model)
    layers = spec.layers
    precision = "bf16-mixed" if args.device == "cuda" else "fp32"
    recipe = Recipe(device=args.device, precision=precision, micro_batch=args.micro_batch, seq_len=args.seq_len)

    device = torch.device(args.device)
    name = hardware.calibration_name(device)

    def predict(plan: tuple[str, ...]) -> Forecast:
        return forecast(spec, recipe.with_(recompute=plan), device_name=name)

    none_peak, full_peak = (predict((mode,) * layers).device_bytes for mode in ("none", "full"))
    budget = parse_size(args.budget) if args.budget else (none_peak + full_peak) // 2
    decision = solve_recipe(spec, recipe, budget=budget, rates=Rates.measure(device), device_name=name)
    print(
        f"budget {format_bytes(budget)} (forecast without recompute {format_bytes(none_peak)}, "
        f"with full {format_bytes(full_peak)})"
    )
    print(f"auto: {decision.line()}")

    ks = sorted({int(k) for k in args.ks.split(",")} | {layers}) if args.ks else range(layers + 1)
    if any(not 0 <= k <= layers for k in ks):
        parser.error(f"--ks: each K must be within 0..{layers}")
    variants = {f"K={k}": str(k) for k in ks} | {"auto": ",".join(decision.plan)}
    plans = {
        variant: tuple(flag.split(",")) if "," in flag else ("full",) * int(flag) + ("none",) * (layers - int(flag))
        for variant, flag in variants.items()
    }
    forecasts = {variant: predict(plan) for variant, plan in plans.items()}
    default = Path(__file__).parent / "results" / f"recompute_{args.model}_{args.device}_{time.strftime('%Y%m%d')}.md"
    out = Path(args.out) if args.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for variant, flag in variants.items():
                record = run_benchmark(args, flag, Path(tmp) / "r.json")
                best = results.get(variant)
                if best is None or _step(record) < _step(best):
                    results[variant] = record
                text = render(args, device, budget, plans, forecasts, results, ks=ks)
                write_atomic(out, lambda f, text=text: f.write((text + "\n").encode()))  # a cut run keeps these
    print(text)
    print(f"written {out}")
    return 0


def render(
    args: argparse.Namespace,
    device: torch.device,
    budget: int,
    plans: dict[str, tuple[str, ...]],
    forecasts: dict[str, Forecast],
    results: dict[str, dict],
    *,
    ks: list[int] | range,
) -> str:
    """The table of the runs so far. The budget is of device memory (reserved, context), the measured peak of
    allocated memory: each plan fits when its measured peak is under the budget less the forecast's reserve and
    context (on CPU the two are one)."""
    layers = len(plans["auto"])
    rows = []
    for variant, plan in plans.items():
        fc, r = forecasts[variant], results.get(variant)
        allowed = allocated_budget(budget, fc)
        rows.append((variant, summary(plan), fc.peak_allocated_bytes, allowed, r))
    lines = [
        f"# recompute: {args.model}, micro batch {args.micro_batch}, seq {args.seq_len}, {device_name(device)}",
        "",
        f"budget {format_bytes(budget)} of device memory; {args.threads} CPU thread(s) per run;"
        f" {time.strftime('%Y-%m-%d')}; torch {torch.__version__}",
        "",
        "| plan | layers recomputed | forecast peak allocated | allocated within the budget | measured peak "
        "allocated | fits | step time p50 (ms) | vs auto |",
        "|---|---|---|---|---|---|---|---|",
    ]
    auto = results.get("auto")
    auto_step = auto and auto["status"] == "ok" and auto["step_time_s_p50"]
    for variant, text, fc, allowed, r in rows:
        measured, step = (r["peak_allocated_bytes"], r["step_time_s_p50"]) if r else (None, None)
        fits = (
            "-"
            if r is None
            else r["status"]
            if r["status"] != "ok" or measured is None
            else ("yes" if measured <= allowed else "no")
        )
        time_ms, vs_auto = ("-", "-") if not (step and auto_step) else (f"{step * 1e3:.1f}", f"{step / auto_step:.3f}")
        lines.append(
            f"| {variant} | {text} | {format_bytes(fc)} | {format_bytes(allowed)} | {format_bytes(measured)} | {fits} "
            f"| {time_ms} | {vs_auto} |"
        )
    lines.append("")
    done = [row for row in rows if row[4] is not None and row[4]["status"] == "ok"]
    fitting = [row for row in done if row[0] != "auto" and row[4]["peak_allocated_bytes"] <= row[3]]
    best_k = min(fitting, key=lambda row: row[4]["step_time_s_p50"]) if fitting else None
    if not auto_step:
        lines.append(f"auto has not finished ({auto['status'] if auto else 'not run yet'}): no ratios")
        return "\n".join(lines)
    _, _, _, auto_allowed, _ = rows[-1]
    lines.append(f"auto measured peak {format_bytes(auto['peak_allocated_bytes'])} within the budget: "
                 f"{auto['peak_allocated_bytes'] <= auto_allowed}")  # fmt: skip
    if best_k:
        sampled = "" if len(ks) == layers + 1 else f" (of the sampled K = {','.join(map(str, ks))})"
        ratio = auto_step / best_k[4]["step_time_s_p50"]
        lines.append(f"auto step time / best fitting {best_k[0]}{sampled}: {ratio:.3f} (target ≤ 1.03)")
    full = results.get(f"K={layers}")
    if full and full["status"] == "ok":
        lines.append(
            f"full recompute step time / auto: {full['step_time_s_p50'] / auto_step:.3f} (auto faster when > 1)"
        )
    return "\n".join(lines)


def run_benchmark(args: argparse.Namespace, recompute: str, output: Path) -> dict:
    cmd = [sys.executable, "-m", "ljperf", "benchmark", "--model", f"torch/{args.model}", "--device", args.device]
    cmd += ["--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    cmd += ["--warmup", "2", "--recompute", recompute, "--threads", str(args.threads), "--output", str(output)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    output.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode == 0:
        return json.loads(output.read_text())["results"]
    # A plan that failed (exit 3: it ran out of memory) is a row of the table, not the end of the comparison.
    print(f"--recompute {recompute}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
    kept = json.loads(output.read_text())["results"] if output.exists() else {}
    return {"peak_allocated_bytes": None, "step_time_s_p50": None} | kept | {"status": kept.get("status", "failed")}


def _step(results: dict) -> float:
    return results["step_time_s_p50"] or math.inf


def device_name(device: torch.device) -> str:
    return hardware.local_device(device.type, 0).name


if __name__ == "__main__":
    sys.exit(main())
