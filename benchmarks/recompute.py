"""Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recompute.py --model llama-tiny --micro-batch 4 --seq-len 1024``
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

from ljperf import hardware, models
from ljperf.checkpoint.apply import summary
from ljperf.checkpoint.solver import Rates, solve_recipe
from ljperf.forecast import Recipe, forecast
from ljperf.result import write_atomic
from ljperf.units import format_bytes, parse_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--budget", help="memory budget, e.g. 60MiB (default: half-way between none and full)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repeats of every plan")
    parser.add_argument(
        "--ks", help="comma-separated K to run (default: every K = 0..L; a subset on a short GPU lease)"
    )
    parser.add_argument(
        "--out", help="markdown file (default: benchmarks/results/recompute_<model>_<device>_<date>.md)"
    )
    args = parser.parse_args()

    spec = models.resolve(name=args.model)
    layers = spec.layers
    precision = "bf16-mixed" if args.device == "cuda" else "fp32"
    recipe = Recipe(device=args.device, precision=precision, micro_batch=args.micro_batch, seq_len=args.seq_len)

    def peak(plan: tuple[str, ...]) -> int:
        return forecast(spec, recipe.with_(recompute=plan)).device_bytes

    none_peak, full_peak = peak(("none",) * layers), peak(("full",) * layers)
    budget = parse_size(args.budget) if args.budget else (none_peak + full_peak) // 2
    device = torch.device(args.device)
    decision = solve_recipe(spec, recipe, budget=budget, rates=Rates.measure(device))
    print(
        f"budget {format_bytes(budget)} (forecast without recompute {format_bytes(none_peak)}, "
        f"with full {format_bytes(full_peak)})"
    )
    print(f"auto: {decision.line()}")

    ks = sorted({int(k) for k in args.ks.split(",")} | {layers}) if args.ks else range(layers + 1)
    if any(not 0 <= k <= layers for k in ks):
        parser.error(f"--ks: each K must be within 0..{layers}")
    variants = {f"K={k}": str(k) for k in ks} | {"auto": ",".join(decision.plan)}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, flag in variants.items():
                record = run_benchmark(args, flag, Path(tmp) / "r.json")
                best = results.get(name)
                if best is None or _step(record) < _step(best):
                    results[name] = record
    rows = []
    for name, flag in variants.items():
        plan = tuple(flag.split(",")) if "," in flag else ("full",) * int(flag) + ("none",) * (layers - int(flag))
        r = results[name]
        rows.append((name, summary(plan), peak(plan), r["peak_allocated_bytes"], r["step_time_s_p50"]))
    ok = [row for row in rows if results[row[0]]["status"] == "ok"]
    fitting = [row for row in ok if row[0] != "auto" and row[3] <= budget]
    best_k = min(fitting, key=lambda row: row[4]) if fitting else None
    auto = rows[-1]
    full = rows[-2]  # K = L, always run
    lines = [
        f"# recompute: {args.model}, micro batch {args.micro_batch}, seq {args.seq_len}, {device_name(device)}",
        "",
        f"budget {format_bytes(budget)}; {time.strftime('%Y-%m-%d')}; torch {torch.__version__}",
        "",
        "| plan | layers recomputed | forecast peak | measured peak | fits | step time p50 (ms) | vs auto |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, text, fc, measured, step), status in zip(rows, (results[n]["status"] for n in variants), strict=True):
        fits = status if status != "ok" or measured is None else "yes" if measured <= budget else "no"
        time_ms, vs_auto = ("-", "-") if not (step and auto[4]) else (f"{step * 1e3:.1f}", f"{step / auto[4]:.3f}")
        lines.append(
            f"| {name} | {text} | {format_bytes(fc)} | {format_bytes(measured)} | {fits} | {time_ms} | {vs_auto} |"
        )
    lines.append("")
    if auto not in ok:
        lines.append(f"auto did not finish ({results['auto']['status']}): no ratios")
    else:
        lines.append(f"auto measured peak {format_bytes(auto[3])} ≤ budget: {auto[3] <= budget}")
        if best_k:
            sampled = "" if len(ks) == layers + 1 else f" (of the sampled K = {','.join(map(str, ks))})"
            ratio = auto[4] / best_k[4]
            lines.append(f"auto step time / best fitting {best_k[0]}{sampled}: {ratio:.3f} (target ≤ 1.03)")
        if full in ok:
            lines.append(f"full recompute step time / auto: {full[4] / auto[4]:.3f} (auto faster when > 1)")
    text = "\n".join(lines)
    print(text)
    default = Path(__file__).parent / "results" / f"recompute_{args.model}_{args.device}_{time.strftime('%Y%m%d')}.md"
    out = Path(args.out) if args.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda f: f.write((text + "\n").encode()))
    print(f"written {out}")
    return 0


def run_benchmark(args: argparse.Namespace, recompute: str, output: Path) -> dict:
    cmd = [sys.executable, "-m", "ljperf", "benchmark", "--model", f"torch/{args.model}", "--device", args.device]
    cmd += ["--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    cmd += ["--warmup", "2", "--recompute", recompute, "--output", str(output)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
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
