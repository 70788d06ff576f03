"""python benchmarks/forecast_fake.py [--models llama3.2-1b,mistral-7b,qwen3-8b] [--out-dir DIR]

The forecast at real sizes without a GPU: for each catalog model (1B-8B), recompute (none, full), shape and
precision, ``ljperf.forecast`` beside PyTorch's ``MemTracker`` over step 2 of the torch engine's full-depth model
on fake tensors (``ljperf.forecast.fakestep``: nothing is allocated, the real HF code runs). The forecast traces a
3- and a 4-layer copy at ≤ 128 tokens, so this checks its composition over depth and its extrapolation in shape.
Target: within 5%. 2 CPU cores: about 10 minutes (an 8B step on fake tensors takes 15-30 s).

Writes ``forecast_fake_cpu_<date>.md`` to ``--out-dir`` (default ``benchmarks/results``) after every row.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch
import transformers

from ljperf import models
from ljperf.forecast import Recipe, forecast
from ljperf.forecast.fakestep import fake_step_peak
from ljperf.result import write_atomic

MODELS = "llama3.2-1b,mistral-7b,qwen3-8b"
SHAPES = ((1, 2048), (2, 4096))
RUNS = (("none", "fp32"), ("full", "fp32"), ("none", "bf16-mixed"), ("full", "bf16-mixed"))
GiB = 1024**3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS, help=f"comma-separated catalog names (default: {MODELS})")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    out = Path(args.out_dir) / f"forecast_fake_cpu_{datetime.date.today():%Y%m%d}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for name in args.models.split(","):
        spec = models.resolve(name=name)
        for (micro_batch, seq_len), (recompute, precision) in ((shape, run) for shape in SHAPES for run in RUNS):
            recipe = Recipe(
                device="cpu",
                precision=precision,
                micro_batch=micro_batch,
                seq_len=seq_len,
                recompute=(recompute,) * spec.layers,
            )
            start = time.perf_counter()
            predicted = forecast(spec, recipe)
            forecast_s = time.perf_counter() - start
            measured = fake_step_peak(spec, recipe)
            row = {
                "model": name,
                "layers": spec.layers,
                "micro_batch": micro_batch,
                "seq_len": seq_len,
                "recompute": recompute,
                "precision": precision,
                "forecast": predicted.peak_allocated_bytes,
                "phase": predicted.phase,
                "measured": measured,
                "forecast_s": forecast_s,
                "measure_s": time.perf_counter() - start - forecast_s,
            }
            rows.append(row)
            print(table(rows[-1:], header=False), end="", flush=True)
            write_atomic(out, lambda f: f.write(table(rows).encode()))
    print(out.read_text())


def table(rows: list[dict], *, header: bool = True) -> str:
    """Markdown: forecast beside MemTracker's peak on fake tensors, with the error and where the peak is."""
    lines = []
    if header:
        lines += [
            f"# Forecast vs MemTracker on a full-size fake step (CPU, torch {torch.__version__}, transformers "
            f"{transformers.__version__})",
            "",
            "`python benchmarks/forecast_fake.py`: torch engine, one process, AdamW (single-tensor, as on CPU), sdpa.",
            "",
            "| model | layers | micro batch | seq len | recompute | precision | forecast GiB | MemTracker GiB | "
            "error % | forecast peak at | forecast s | fake step s |",
            "|---|---:|---:|---:|---|---|---:|---:|---:|---|---:|---:|",
        ]
    for r in rows:
        error = 100 * (r["forecast"] - r["measured"]) / r["measured"]
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['micro_batch']} | {r['seq_len']} | {r['recompute']} | "
            f"{r['precision']} | {r['forecast'] / GiB:.3f} | {r['measured'] / GiB:.3f} | {error:+.2f} | "
            f"{r['phase']} | {r['forecast_s']:.1f} | {r['measure_s']:.1f} |"
        )
    if header:
        worst = max(abs(r["forecast"] - r["measured"]) / r["measured"] for r in rows)
        lines += ["", f"max |error| {100 * worst:.2f}% over {len(rows)} configurations (target: 5%)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
