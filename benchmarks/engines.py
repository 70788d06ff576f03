"""python benchmarks/engines.py [--model llama-tiny] [--nproc-per-node 2] [--device cpu|cuda] [--steps 10]

All engines side by side on one model, each through ``ljperf benchmark`` with the same global batch:
torch/DDP, FSDP2, DeepSpeed ZeRO-1/2/3. Prints step time, throughput, peak memory (max rank) and the
final loss, with ratios to torch/DDP. On CPU the processes use gloo; ``--device cuda`` runs the same on GPUs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from ljperf.core.console import console
from ljperf.core.records import read_json
from ljperf.core.units import format_bytes

ENGINES = {
    "torch/DDP": ["--model", "torch/{model}"],
    "FSDP2": ["--model", "fsdp/{model}"],
    "ZeRO-1": ["--model", "deepspeed/{model}", "--zero-stage", "1"],
    "ZeRO-2": ["--model", "deepspeed/{model}", "--zero-stage", "2"],
    "ZeRO-3": ["--model", "deepspeed/{model}", "--zero-stage", "3"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank, every engine (default: 1)")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    common = ["--threads", str(args.threads),
        "--nproc-per-node", str(args.nproc_per_node), "--device", args.device, "--seq-len", str(args.seq_len),
        "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--warmup", "3",
    ]  # fmt: skip
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in ENGINES.items():
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "ljperf", "benchmark", *(f.format(model=args.model) for f in flags)]
            console.print(f"[bold]{name}[/]: {' '.join(cmd[3:] + common)}")
            proc = subprocess.run([*cmd, *common, "--output", str(out)], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                console.print(f"[red]{name} failed (exit {proc.returncode})[/]: {proc.stderr.strip()[-500:]}")
                continue
            records[name] = read_json(out)["results"]
    print_table(records, title=f"{args.model} · {args.nproc_per_node} × {args.device} ({args.threads} thread(s) each)"
                f" · mb {args.micro_batch} × seq {args.seq_len} · median of {args.steps} steps")  # fmt: skip
    return 0 if len(records) == len(ENGINES) else 1


def print_table(records: dict[str, dict], *, title: str) -> None:
    base = records.get("torch/DDP")
    table = Table(title=title)
    for col in ("engine", "step p50 ms", "× DDP", "tokens/s", "× DDP", "peak mem (max rank)", "× DDP", "last loss"):
        table.add_column(col, justify="left" if col == "engine" else "right")

    def ratio(res: dict, key: str) -> str:
        return f"{res[key] / base[key]:.2f}" if base and res.get(key) and base.get(key) else "-"

    for name, res in records.items():
        table.add_row(
            name,
            f"{res['step_time_s_p50'] * 1e3:.1f}",
            ratio(res, "step_time_s_p50"),
            f"{res['tokens_per_s']:,.0f}",
            ratio(res, "tokens_per_s"),
            format_bytes(res["peak_allocated_bytes"]),
            ratio(res, "peak_allocated_bytes"),
            f"{res['losses'][-1]:.4f}",
        )
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
