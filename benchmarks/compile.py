"""Eager vs regional vs whole-model torch.compile, side by side: steady-state step time and compile time.

Run: ``.venv/bin/python benchmarks/compile.py [--model torch/llama-tiny] [--seq-len 256] [--micro-batch 2]``
GPU: ``python benchmarks/compile.py --device cuda --model torch/llama3.2-1b --seq-len 2048 --micro-batch 4
--markdown benchmarks/compile_llama3.2-1b_<gpu>_<date>.md`` (bf16-mixed is the GPU default; target ≥ 1.20× eager).
A ``deepspeed/`` model compares eager, regional and DeepSpeed's ``engine.compile()`` (DeepCompile on CUDA),
e.g. ``--model deepspeed/llama3.2-1b -- --nproc-per-node 1``: keep the faster as the default for ZeRO.

Each mode is one ``ljperf benchmark`` process (``--compile-mode off|regional|whole``), modes interleaved per
repeat so machine drift hits them alike. Every process gets an empty inductor cache (cold compile times)
unless ``--warm-cache``. Step time is the p50 of the timed steps (compilation happens in the warm-up steps);
compile time is the time dynamo/inductor report (``results.compile.time_s``). Extra ``ljperf benchmark``
flags go after ``--``. The table is written again after every run (a run cut short keeps the ones before it),
and a mode that fails is a row with its reason; the others still run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ljperf.core.records import read_json, versions, write_atomic

MODES = ("off", "regional", "whole")
DEEPSPEED_MODES = ("off", "regional", "deepspeed")
"""For a deepspeed/ model: regional vs DeepSpeed's own engine.compile() (with DeepCompile on CUDA)."""


def run_mode(mode: str, args: argparse.Namespace, workdir: Path, index: int) -> dict | str:
    """The mode's benchmark record, or why it failed."""
    out = workdir / f"{mode}-{index}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if not args.warm_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=workdir)
    cmd = [
        sys.executable, "-m", "ljperf", "benchmark", "--model", args.model, "--device", args.device,
        "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--compile-mode", mode, "--threads", str(args.threads), "--output", str(out),
        *args.extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"{mode} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
        last = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        return f"failed (exit {proc.returncode}): {last}"
    return read_json(out)


def summarize(records: list[dict]) -> dict:
    res = [r["results"] for r in records]
    comp = [r.get("compile") or {} for r in res]
    return {
        "step_s": statistics.median(r["step_time_s_p50"] for r in res),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in res),
        "compile_s": statistics.median(c.get("time_s", 0.0) for c in comp),
        "graph_breaks": max(c.get("graph_breaks", 0) for c in comp),
        "recompiles": max(c.get("recompiles", 0) for c in comp),
        "fallbacks": max(len(c.get("fallbacks", [])) for c in comp),
        "final_loss": res[0]["losses"][-1],
    }


def table(rows: dict[str, dict | str], header: str) -> str:
    """One row per mode: its summary, or why it failed."""
    eager = rows["off"]["tokens_per_s"] if isinstance(rows.get("off"), dict) else None
    lines = [
        header,
        "",
        "| mode | step time p50 | tokens/s | × eager tokens/s | compile time | graph breaks | recompiles | fallbacks |"
        " final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        "| | ms | tokens/s | × | s | | | | nats |",
    ]
    for mode, s in rows.items():
        if isinstance(s, str):
            lines.append(f"| {'eager' if mode == 'off' else mode} | {s} | | | | | | | |")
            continue
        ratio = f"{s['tokens_per_s'] / eager:.2f}" if eager else "-"
        lines.append(
            f"| {'eager' if mode == 'off' else mode} | {s['step_s'] * 1e3:.1f} | {s['tokens_per_s']:,.0f} | {ratio} "
            f"| {s['compile_s']:.1f} | {s['graph_breaks']} | {s['recompiles']} | {s['fallbacks']} "
            f"| {s['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="torch/llama-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds of all modes; medians reported")
    parser.add_argument(
        "--modes",
        help="comma-separated subset of off,regional,whole,deepspeed (default: off,regional,whole; for a "
        "deepspeed/ model off,regional,deepspeed)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))),
        help="CPU threads of every benchmark process, the same for all modes (default: $OMP_NUM_THREADS, else all"
        " cores)",
    )
    parser.add_argument("--warm-cache", action="store_true", help="reuse the inductor cache (warm compile times)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table (with versions) to this file")
    parser.add_argument("extra", nargs="*", help="more ljperf benchmark flags, after --")
    args = parser.parse_args()
    default = DEEPSPEED_MODES if args.model.startswith("deepspeed/") else MODES
    modes = [m for m in (args.modes or ",".join(default)).split(",") if m]
    records: dict[str, list[dict]] = {m: [] for m in modes}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ljperf-compile-bench-") as tmp:
        for i in range(args.repeat):
            for mode in (m for m in modes if m not in failed):
                got = run_mode(mode, args, Path(tmp), i)
                if isinstance(got, str):
                    failed[mode] = got
                else:
                    records[mode].append(got)
                    res = got["results"]
                    print(
                        f"round {i + 1}/{args.repeat} {mode}: step p50 {res['step_time_s_p50'] * 1e3:.1f} ms, "
                        f"{res['tokens_per_s']:,.0f} tokens/s, "
                        f"compile {(res.get('compile') or {}).get('time_s', 0):.1f} s",
                        file=sys.stderr,
                    )
                text = render(records, failed, args)
                if args.markdown:  # after every run: a session cut short keeps what finished
                    write_atomic(args.markdown, lambda f, text=text: f.write((text + "\n").encode()))
    print(text)
    if failed:
        raise SystemExit(f"{len(failed)} mode(s) failed: {', '.join(failed)}")


def render(records: dict[str, list[dict]], failed: dict[str, str], args: argparse.Namespace) -> str:
    """The header and the table of the runs so far."""
    rows: dict[str, dict | str] = {m: summarize(r) for m, r in records.items() if r}
    rows |= failed
    first = next((r[0] for r in records.values() if r), None)
    device = first["env"]["devices"][0] if first else args.device
    precision = first["config"]["train"]["precision"] if first else "-"
    ver = versions()
    header = (
        f"## torch.compile: {args.model} · {device} · mb {args.micro_batch} × seq {args.seq_len} · "
        f"{precision} · {args.steps} steps × {args.repeat} round(s) · {args.threads} CPU thread(s) · "
        f"{'warm' if args.warm_cache else 'cold'} inductor cache\n\n"
        f"torch {ver.get('torch')}, transformers {ver.get('transformers')}, ljperf {ver.get('ljperf')}; "
        f"extra flags: {' '.join(args.extra) or 'none'}"
    )
    return table(rows, header)


if __name__ == "__main__":
    main()
