"""python benchmarks/engines.py [--model llama-tiny] [--nproc-per-node 1] [--device cpu|cuda] [--compile both]

Every engine's own cost, side by side on one model at one shape, each through ``ljperf benchmark`` with the same
global batch: torch/DDP, FSDP2, DeepSpeed ZeRO-1/2/3, eager and regionally compiled. On one device the engines'
collectives are local copies, so what they cost beyond the torch engine is their own overhead; the step's
breakdown (forward, backward, optimizer, communication, other: ``results.breakdown``) says where it goes.
Rounds are interleaved (every engine and mode once per round, ``--rounds`` of them) so machine drift hits all
alike; each row is the median of its rounds. Prints step time, tokens/s and peak memory (max rank) with ratios
to the torch engine in the same mode, compiled ÷ eager per engine, and writes the table as markdown (``--out``).
GPU (#38's targets: FSDP2 ≥ 0.95×, ZeRO-1/2 ≥ 0.90×, ZeRO-3 ≥ 0.80× torch; compile ≥ 1.15× eager inside FSDP2
and ZeRO-3): ``python benchmarks/engines.py --device cuda --model llama3.2-1b --micro-batch 4 --seq-len 2048
--nproc-per-node 1 --precision bf16-mixed --out benchmarks/results/engines_h200.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ljperf.core.records import git_revision, read_json, versions, write_atomic
from ljperf.core.units import format_bytes

ENGINES = {
    "torch/DDP": ["--model", "torch/{model}"],
    "FSDP2": ["--model", "fsdp/{model}"],
    "ZeRO-1": ["--model", "deepspeed/{model}", "--zero-stage", "1"],
    "ZeRO-2": ["--model", "deepspeed/{model}", "--zero-stage", "2"],
    "ZeRO-3": ["--model", "deepspeed/{model}", "--zero-stage", "3"],
}
MODES = {"eager": [], "compiled": ["--compile"]}
PHASES = ("forward", "backward", "optimizer", "communication", "other")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", help="--precision of every run (default: the benchmark's)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every run; medians reported")
    parser.add_argument("--compile", default="both", choices=("both", "off", "on"), help="eager, compiled or both")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma list of " + ", ".join(ENGINES))
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank, every engine (default: 1)")
    parser.add_argument("--out", type=Path, help="write the table as markdown here too")
    return parser.parse_args()


def run_one(engine: str, mode: str, args: argparse.Namespace, out: Path) -> dict | str:
    """One ``ljperf benchmark`` process; its results, or why it failed."""
    flags = [f.format(model=args.model) for f in ENGINES[engine]] + MODES[mode]
    common = ["--threads", str(args.threads), "--nproc-per-node", str(args.nproc_per_node), "--device", args.device,
              "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
              "--warmup", "3", "--output", str(out)]  # fmt: skip
    common += ["--precision", args.precision] if args.precision else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run([sys.executable, "-m", "ljperf", "benchmark", *flags, *common], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:200]}"
    return read_json(out)["results"]


def summarize(results: list[dict]) -> dict:
    """The median of each figure over the rounds."""
    row = {k: statistics.median(r[k] for r in results) for k in ("step_time_s_p50", "tokens_per_s")}
    row["peak"] = max(r["peak_allocated_bytes"] for r in results)
    row["ms"] = {p: statistics.median(r["breakdown"]["ms"][p] for r in results) for p in PHASES}
    row["loss"] = results[-1]["losses"][-1]
    return row


def render(rows: dict[tuple[str, str], dict | str], args: argparse.Namespace) -> str:
    """The markdown table: one row per engine and mode, ratios to torch in the same mode and to eager."""
    head = ["engine", "mode", "step p50 ms", "tokens/s", "× torch", "× eager", "peak (max rank)", "× torch",
            *(f"{p} ms" for p in PHASES), "last loss"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (engine, mode), row in rows.items():
        if isinstance(row, str):
            lines.append(f"| {engine} | {mode} | failed: {row} |")
            continue
        torch_row, eager = rows.get(("torch/DDP", mode)), rows.get((engine, "eager"))

        def ratio(other: dict | str | None, key: str, row: dict = row) -> str:
            return f"{row[key] / other[key]:.2f}" if isinstance(other, dict) and other[key] else "-"

        cells = [engine, mode, f"{row['step_time_s_p50'] * 1e3:.1f}", f"{row['tokens_per_s']:,.0f}",
                 ratio(torch_row, "tokens_per_s"), ratio(eager, "tokens_per_s") if mode != "eager" else "-",
                 format_bytes(row["peak"]), ratio(torch_row, "peak"), *(f"{row['ms'][p]:.1f}" for p in PHASES),
                 f"{row['loss']:.4f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    title = (f"{args.model} · {args.nproc_per_node} × {args.device} ({args.threads} thread(s) each) · mb "
             f"{args.micro_batch} × seq {args.seq_len} · median of {args.rounds} interleaved round(s) of "
             f"{args.steps} steps")  # fmt: skip
    ver = ", ".join(f"{k} {v}" for k, v in versions().items() if v)
    footer = f"Commit {git_revision() or 'unknown'}; {ver}."
    return f"# Engines side by side\n\n{title}\n\n" + "\n".join(lines) + f"\n\n{footer}\n"


def main() -> int:
    args = parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if unknown := [e for e in engines if e not in ENGINES]:
        print(f"engines.py: unknown engine {unknown[0]!r}; choose from {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    modes = {"both": list(MODES), "off": ["eager"], "on": ["compiled"]}[args.compile]
    results: dict[tuple[str, str], list[dict]] = {(e, m): [] for e in engines for m in modes}
    failed: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for key in results:
                if key in failed:
                    continue
                print(f"round {round_ + 1}/{args.rounds}: {key[0]} {key[1]}", file=sys.stderr, flush=True)
                got = run_one(*key, args, Path(tmp) / "result.json")
                if isinstance(got, str):
                    failed[key] = got
                else:
                    results[key].append(got)
    rows = {k: failed.get(k) or summarize(v) for k, v in results.items()}
    text = render(rows, args)
    print(text)
    if args.out:
        write_atomic(args.out, lambda f: f.write(text.encode()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
