"""``ljperf plan --search`` against measured runs: does its pick run fastest, and does every recipe fit?

Run: ``.venv/bin/python benchmarks/search.py [--models llama-tiny,qwen-tiny] [--repeats 2] [--budget 96MiB]
[--markdown FILE]`` (about an hour on the 2-core machine). For each model: the search on a 2-process CPU "cluster"
(fp32, ``--threads 1``, a held global batch), then its top 5 and 5 other fitting recipes drawn at random (seeded),
each run by ``ljperf benchmark --recipe`` (one process per rank, ``OMP_NUM_THREADS=1``), the ten shuffled anew in
each repeat so machine drift hits them alike. A run's throughput is its tokens per device over its measured step in
device seconds (``results.speed.measured_step_time_s``: a process's CPU time per thread; the wall time of the shared
machine holds the waits for a core); a recipe's, the median over its repeats. The table: predicted and measured
tokens/s per device and the measured peak of each against the budget; the footer: the pick's measured throughput over
the best measured (the issue's target: ≥ 0.95) and whether every run stayed within the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def ljperf(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ljperf", *argv], env=env, capture_output=True, text=True, check=False)


def searched(model: str, *, budget: str, global_batch: int, seq_len: int, env: dict[str, str]) -> dict:
    argv = ["plan", "--model", model, "--gpus", "2", "--device", "cpu", "--precision", "fp32", "--threads", "1",
            "--seq-len", str(seq_len), "--gpu-memory", budget, "--search", "--global-batch", str(global_batch),
            "--json"]  # fmt: skip
    done = ljperf(*argv, env=env)
    if done.returncode != 0:
        raise SystemExit(f"search of {model} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def picked(record: dict, *, seed: int) -> list[dict]:
    """The top 5 ranked recipes and 5 others that fit, drawn at random."""
    ranked = record["ranked"]
    rest = ranked[5:]
    return ranked[:5] + random.Random(seed).sample(rest, min(5, len(rest)))


def measured(entry: dict, folder: Path, repeat: int, *, steps: int, env: dict[str, str]) -> dict | None:
    """One benchmark run of ``entry``: its tokens/s per device (device seconds) and peak, or None if it failed."""
    recipe, out = folder / f"recipe{entry['rank']}.json", folder / f"run{entry['rank']}_r{repeat}.json"
    recipe.write_text(json.dumps(entry))
    done = ljperf("benchmark", "--recipe", str(recipe), "--steps", str(steps), "--warmup", "2", "--output", str(out),
                  env=env)  # fmt: skip
    if done.returncode != 0:
        print(f"  #{entry['rank']} failed: {(done.stderr.strip().splitlines() or [''])[-1][:200]}", file=sys.stderr)
        return None
    results = json.loads(out.read_text())["results"]
    c = entry["candidate"]
    tokens = c["micro_batch"] * c["grad_accum"] * int(entry["argv"][entry["argv"].index("--seq-len") + 1])
    tokens //= c["layout"]["tp"]
    step = results["speed"]["measured_step_time_s"]
    return {"tokens_per_s": tokens / step, "peak": max(results["peak_allocated_bytes_per_rank"])}


def validate(model: str, args: argparse.Namespace, env: dict[str, str]) -> tuple[list[str], float, bool]:
    """The table rows of ``model``, the pick's measured throughput over the best, and whether all fit."""
    record = searched(model, budget=args.budget, global_batch=args.global_batch, seq_len=args.seq_len, env=env)
    entries = picked(record, seed=args.seed)
    runs: dict[int, list[dict]] = {e["rank"]: [] for e in entries}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = random.Random(args.seed + repeat).sample(entries, len(entries))
            for entry in order:
                if (m := measured(entry, Path(tmp), repeat, steps=args.steps, env=env)) is not None:
                    runs[entry["rank"]].append(m)
    budget = record["memory_budget_bytes"]
    speeds = {r: statistics.median(m["tokens_per_s"] for m in ms) for r, ms in runs.items() if ms}
    peaks = {r: max(m["peak"] for m in ms) for r, ms in runs.items() if ms}
    rows = [
        f"| {model} | {e['rank']} | {e['recipe']} | {e['speed']['tokens_per_s_per_device']:,.0f} |"
        f" {speeds.get(e['rank'], float('nan')):,.0f} | {peaks.get(e['rank'], 0) / 2**20:.2f} |"
        f" {e['peak_bytes'] / 2**20:.2f} | {budget / 2**20:.0f} |"
        for e in entries
    ]
    pick = speeds.get(1, 0.0) / max(speeds.values()) if speeds else 0.0
    return rows, pick, all(p <= budget for p in peaks.values()) and len(peaks) == len(entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-tiny,qwen-tiny")
    parser.add_argument("--budget", default="96MiB")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", metavar="FILE")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    lines = [
        "| model | rank | recipe | predicted tokens/s/device | measured | measured peak MiB | forecast MiB"
        " | budget MiB |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    footer = []
    for model in args.models.split(","):
        rows, pick, fit = validate(model, args, env)
        lines += rows
        footer.append(f"{model}: the pick measured {pick:.3f} × the best of the ten; all within the budget: {fit}")
    text = "\n".join([*lines, "", *footer])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
