"""Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recompute.py --model llama-tiny --micro-batch 4 --seq-len 512``
(GPU: ``python benchmarks/recompute.py --device cuda --model llama3.2-1b --micro-batch 4 --seq-len 2048
--fractions 0.5 --plans near --rounds 1 --steps 3``, about 3 minutes).

Auto recompute against the oracle: at budgets a quarter, half and three quarters of the way from full
recompute's forecast peak to no recompute's (rounded up to a MiB), every plan the solver considers
(``f`` layers full, then ``s`` selective: first-K full, selective for the first K or all, and their mixtures)
is forecast; each that fits one of the budgets is measured by a real ``ljperf benchmark`` run in its own
process, and so is ``--recompute auto`` under each budget. Rounds are interleaved (shuffled, seeded); a plan's
figure is the median over rounds of each run's median step (CPU time on a CPU). Per budget it prints auto's plan
and step time, the fastest measured plan that fits and their ratio (target ≤ 1.02), and writes the tables with
the commit and versions to
``benchmarks/results/recompute_<model>_<device>_<date>.md``. ``--plans staircase`` measures only the plans that
can be fastest (for each number of full layers, the fewest selective that fit a budget), ``near`` only auto's
neighbours on that staircase (one full layer fewer and one more).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from ljperf.core import hardware
from ljperf.core.plans import Plan, describe, summary
from ljperf.core.records import write_atomic
from ljperf.core.spread import Spread
from ljperf.core.units import format_bytes
from ljperf.forecast import Forecast, Recipe, forecast
from ljperf.models.spec import resolve
from ljperf.recompute.closed_loop import allocated_budget
from ljperf.recompute.cost import Rates, RecomputeCost, layer_cost, run_rates
from ljperf.recompute.solver import ordered_plan, solve_recipe

MIB = 2**20


@dataclass(kw_only=True)
class Sweep:
    """What was forecast, decided and measured so far."""

    budgets: list[int]
    predict: Callable[[Plan], Forecast]
    """A plan's forecast (each made once)."""
    auto: list[Plan]
    """The plan the solver chose under each budget (this process's solve, with the cached rates)."""
    measured: list[Plan]
    records: dict[str, list[dict]] = field(default_factory=dict)
    """Per run name (a plan's flag, or ``auto@<budget index>``): its records, one a round."""

    cpu_time: bool = False
    """Compare CPU seconds per step (median over a run's steps): a shared CPU's wall time mostly measures the
    other processes."""

    def step(self, name: str) -> Spread | None:
        return Spread.of([t for r in self.records.get(name, []) if (t := self.seconds(r))])

    def wall(self, name: str) -> Spread | None:
        return Spread.of([r["step_time_s_p50"] for r in self.records.get(name, []) if r.get("step_time_s_p50")])

    def seconds(self, record: dict) -> float | None:
        if not self.cpu_time:
            return record.get("step_time_s_p50")
        return statistics.median(record["step_cpu_times_s"]) if record.get("step_cpu_times_s") else None

    def fits(self, plan: Plan, budget: int, name: str | None = None) -> bool:
        """Measured (every round's peak allocated within the budget less the forecast's reserve), else forecast."""
        allowed = allocated_budget(budget, self.predict(plan))
        runs = self.records.get(name or flag(plan), [])
        if runs:
            return all(r.get("peak_allocated_bytes") is not None and r["peak_allocated_bytes"] <= allowed for r in runs)
        return self.predict(plan).device_bytes <= budget


def main() -> int:
    args = parse_args()
    spec = resolve(name=args.model)
    precision = "bf16-mixed" if args.device == "cuda" else "fp32"
    recipe = Recipe(device=args.device, precision=precision, micro_batch=args.micro_batch, seq_len=args.seq_len)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)  # the rates' cache key: the benchmark runs find the same entry
    name = hardware.calibration_name(device)
    layers = spec.layers
    predict = functools.cache(lambda plan: forecast(spec, recipe.with_(recompute=plan), device_name=name))

    def peak(plan: Plan) -> int:
        return predict(plan).device_bytes

    none, full = (peak(ordered_plan(layers, f, 0)) for f in (0, layers))
    budgets = [full + math.ceil(x * (none - full) / MIB) * MIB for x in args.fractions]
    shape = {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "attn": recipe.attn_implementation}
    cost = layer_cost(spec, **shape)
    rates = run_rates(spec, cost, **shape, device=device, bf16=precision != "fp32")  # as the benchmark runs rank
    auto = [solve_recipe(spec, recipe, budget=b, rates=rates, cost=cost, device_name=name).plan for b in budgets]
    measured = chosen(args.plans, peak, layers, budgets, auto)
    sweep = Sweep(budgets=budgets, predict=predict, auto=auto, measured=measured, cpu_time=args.device == "cpu")
    for b, plan in zip(budgets, auto, strict=True):
        print(f"budget {format_bytes(b)}: auto {describe(plan)}; {len(measured)} plans to run")
    runs = {flag(p): ("--recompute", flag(p)) for p in sweep.measured}
    runs |= {f"auto@{i}": ("--recompute", "auto", "--memory-budget", str(b)) for i, b in enumerate(budgets)}
    default = f"recompute_{args.model}_{args.device}_{time.strftime('%Y%m%d')}.md"
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / default
    out.parent.mkdir(parents=True, exist_ok=True)
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for run, extra in random.Random(round_).sample(list(runs.items()), len(runs)):  # no run always last
                sweep.records.setdefault(run, []).append(run_benchmark(args, extra, Path(tmp) / "r.json"))
                loads.append(os.getloadavg()[0])
                text = render(args, sweep, rates=rates, cost=cost, loads=loads)
                write_atomic(out, lambda f, text=text: f.write((text + "\n").encode()))  # a cut run keeps these
    print(text)
    print(f"written {out}")
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--fractions", type=lambda t: [float(x) for x in t.split(",")], default=[0.25, 0.5, 0.75],
        help="budgets, as the share of the way from full recompute's forecast peak to no recompute's",
    )  # fmt: skip
    parser.add_argument("--plans", default="all", choices=("all", "staircase", "near"), help="which plans to run")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every run")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of every process (default: 1)")
    parser.add_argument("--out", help="markdown file (default: results/recompute_<model>_<device>_<date>.md)")
    return parser.parse_args()


def flag(plan: Plan) -> str:
    return ",".join(plan)


def chosen(which: str, peak: Callable[[Plan], int], layers: int, budgets: list[int], auto: list[Plan]) -> list[Plan]:
    """The plans to run: every plan that fits a budget (``all``), the fewest selective layers that fit for each
    number of full layers (``staircase``), or those next to auto's, one full layer fewer and one more (``near``:
    a few forecasts, not all (L + 1)(L + 2) / 2)."""
    picked: set[Plan] = set()
    for budget, plan in zip(budgets, auto, strict=True):
        f_auto = plan.count("full")
        fulls = range(layers + 1) if which != "near" else [f for f in (f_auto - 1, f_auto + 1) if 0 <= f <= layers]
        for f in fulls:
            row = [ordered_plan(layers, f, s) for s in range(layers + 1 - f)]
            if which == "all":
                picked |= {p for p in row if peak(p) <= budget}
            elif peak(row[-1]) <= budget:  # the fewest selective that fit: the peak falls as s grows
                lo, hi = -1, len(row) - 1
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if peak(row[mid]) <= budget else (mid, hi)
                picked.add(row[hi])
        if which == "near":
            picked.add(plan)
    return sorted(picked, key=lambda p: (p.count("full"), p.count("selective")))


def render(args: argparse.Namespace, sweep: Sweep, *, rates: Rates, cost: RecomputeCost, loads: list[float]) -> str:
    """The plans' table and, per budget, auto against the fastest measured plan that fits."""
    lines = [
        f"# recompute: auto against the oracle, {args.model}, micro batch {args.micro_batch}, seq {args.seq_len}, "
        f"{hardware.local_device(args.device, 0).name}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}; ljperf {commit()}; torch {torch.__version__}; transformers "
        f"{transformers.__version__}; python "
        f"{platform.python_version()}; {args.threads} CPU thread(s) per run; {args.rounds} interleaved rounds of "
        f"{args.steps} steps (after 2 warmup); load average {min(loads):.1f}–{max(loads):.1f} during the runs",
        "",
        f"rates (from one layer timed at this shape, cached): {rates.flops_per_s / 1e9:.1f} GFLOP/s matmul, "
        f"{rates.bytes_per_s / 1e9:.2f} GB/s memory-bound; estimated recompute per layer: full "
        f"{cost.seconds('full', rates) * 1e3:.1f} ms, selective {cost.seconds('selective', rates) * 1e3:.1f} ms",
        "",
        f"step: {'CPU' if sweep.cpu_time else 'wall'} time, each run's median step, median over the rounds"
        + (" (wall time beside it: the time waiting for a core)" if sweep.cpu_time else ""),
        "",
        "| plan (full, selective) | layers | forecast peak allocated | measured | step (ms) | min–max over rounds "
        "(ms) | spread | wall (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for plan in sweep.measured:
        fc, runs, step = sweep.predict(plan), sweep.records.get(flag(plan), []), sweep.step(flag(plan))
        peak = runs[-1].get("peak_allocated_bytes") if runs else None
        lines.append(
            f"| ({plan.count('full')}, {plan.count('selective')}) | {describe(plan)} | "
            f"{format_bytes(fc.peak_allocated_bytes)} | {format_bytes(peak)} | {ms(step)} | {range_ms(step)} | "
            f"{spread(step)} | {ms(sweep.wall(flag(plan)))} |"
        )
    if fitted := per_layer(sweep):
        full_ms, selective_ms = fitted
        lines += ["", f"measured recompute per layer (least squares of step = base + full × F + selective × S over"
                      f" the plans): full {full_ms:.1f} ms, selective {selective_ms:.1f} ms"]  # fmt: skip
    lines += ["", *budget_table(sweep)]
    return "\n".join(lines)


def per_layer(sweep: Sweep) -> tuple[float, float] | None:
    """(F, S) in ms, fitted to the measured plans' step times; None with fewer than 4 plans measured or when
    their counts of full and selective layers do not separate the two."""
    rows = [(p.count("full"), p.count("selective"), s.median) for p in sweep.measured if (s := sweep.step(flag(p)))]
    if len(rows) < 4:
        return None
    a = torch.tensor([[1.0, f, s] for f, s, _ in rows], dtype=torch.float64)
    if torch.linalg.matrix_rank(a) < 3:
        return None
    solution = torch.linalg.lstsq(a, torch.tensor([[t] for *_, t in rows], dtype=torch.float64)).solution
    return 1e3 * solution[1, 0].item(), 1e3 * solution[2, 0].item()


def budget_table(sweep: Sweep) -> list[str]:
    """Per budget: auto's plan and step time, the same plan run as a fixed plan (the same work: the difference is
    noise), the fastest measured plan that fits and the ratios of the two to it (``≈``: their ranges over the
    rounds overlap)."""
    lines = [
        "| budget | auto's plan | auto (ms) | same plan fixed (ms) | fastest fitting plan | its step (ms) | "
        "auto / fastest | fixed / fastest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (budget, planned) in enumerate(zip(sweep.budgets, sweep.auto, strict=True)):
        runs = sweep.records.get(f"auto@{i}", [])
        ran = {tuple(r["recompute"]["plan"]) for r in runs if r.get("recompute")}
        plan = next(iter(ran)) if len(ran) == 1 else planned
        auto = sweep.step(f"auto@{i}")
        fitting = [p for p in sweep.measured if sweep.fits(p, budget) and sweep.step(flag(p))]
        best = min(fitting, key=lambda p: sweep.step(flag(p)).median, default=None)
        best_step = sweep.step(flag(best)) if best else None
        fixed = sweep.step(flag(plan))
        ratios = [
            f"{s.median / best_step.median:.3f}" + (" ≈" if s.overlaps(best_step) and s != best_step else "")
            if s and best_step
            else "-"
            for s in (auto, fixed)
        ]
        named = summary(plan) if len(ran) <= 1 else f"{len(ran)} plans over the rounds: {sorted(ran)}"
        if ran and plan != planned:
            named += f" (this process's solve: {summary(planned)})"
        fits = "" if not runs or sweep.fits(plan, budget, f"auto@{i}") else " (over the budget)"
        lines.append(
            f"| {format_bytes(budget)} | {named}{fits} | {ms(auto)} | {ms(fixed)} | "
            f"{summary(best) if best else '-'} | {ms(best_step)} | {ratios[0]} | {ratios[1]} |"
        )
    lines += ["", "≈: the two min–max ranges over the rounds overlap (these repeats do not separate them)."]
    return lines


def ms(s: Spread | None) -> str:
    return "-" if s is None else f"{s.median * 1e3:.1f}"


def range_ms(s: Spread | None) -> str:
    return "-" if s is None else f"{s.low * 1e3:.1f}–{s.high * 1e3:.1f}"


def spread(s: Spread | None) -> str:
    return "-" if s is None else f"{(s.high - s.low) / s.median:.1%}"


def commit() -> str:
    root = Path(__file__).parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
    except OSError:
        return "unknown"
    return (head.stdout.strip() or "unknown") + (" (uncommitted changes)" if dirty else "")


def run_benchmark(args: argparse.Namespace, extra: tuple[str, ...], output: Path) -> dict:
    cmd = [sys.executable, "-m", "ljperf", "benchmark", "--model", f"torch/{args.model}", "--device", args.device]
    cmd += ["--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    cmd += ["--warmup", "2", "--threads", str(args.threads), "--output", str(output), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    output.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode == 0:
        return json.loads(output.read_text())["results"]
    # A plan that failed (exit 3: it ran out of memory) is a row of the table, not the end of the comparison.
    print(f"{' '.join(extra)}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
    kept = json.loads(output.read_text())["results"] if output.exists() else {}
    return {"peak_allocated_bytes": None, "step_time_s_p50": None} | kept


if __name__ == "__main__":
    sys.exit(main())
