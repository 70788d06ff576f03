"""python benchmarks/forecast_fake.py [--engine torch|fsdp] [--world N] [--models llama3.2-1b,...] [--out-dir DIR]
[--loss plain|chunked] [--shapes 1x2048,2x4096] [--runs none/fp32,full/bf16-mixed,...]

The forecast at real sizes without a GPU: for each catalog model (1B-8B), recompute (none, full), shape and
precision, ``ljperf.forecast`` beside PyTorch's ``MemTracker`` over step 2 of the engine's full-size model on fake
tensors (``ljperf.forecast.fakestep``: nothing is allocated, the real HF code runs; FSDP2 is rank 0 of ``--world``
ranks on a fake process group). The forecast traces a 3- and a 4-layer copy at ≤ 128 tokens, so this checks its
composition over depth, its extrapolation in shape and, for FSDP2, its analytic sharding terms. Target: within 5%.
2 CPU cores: about 20 minutes for the torch engine (an 8B step on fake tensors takes 20-60 s).

Writes ``forecast_fake_<engine>-<world>_cpu_<date>.md`` to ``--out-dir`` (default ``benchmarks/results``) after
every row.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch
import transformers

from ljperf.benchmark.fakestep import fake_step_peak
from ljperf.core.records import write_atomic
from ljperf.forecast import Recipe, forecast
from ljperf.models.spec import resolve

MODELS = "llama3.2-1b,mistral-7b,qwen3-8b"
SHAPES = ((1, 2048), (2, 4096))
RUNS = (("none", "fp32"), ("full", "fp32"), ("none", "bf16-mixed"), ("full", "bf16-mixed"))
GiB = 1024**3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("torch", "fsdp"), default="torch")
    parser.add_argument("--world", type=int, help="ranks (default: 1 for torch, 8 for fsdp)")
    parser.add_argument("--models", default=MODELS, help=f"comma-separated catalog names (default: {MODELS})")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--loss", choices=("plain", "chunked"), default="plain", help="--loss of every run")
    parser.add_argument("--shapes", help="micro batch x sequence, comma-separated (default: 1x2048,2x4096)")
    parser.add_argument("--runs", help="recompute/precision, comma-separated (default: the four of none, full × fp32,"
                        " bf16-mixed)")  # fmt: skip
    args = parser.parse_args()
    world = args.world or (8 if args.engine == "fsdp" else 1)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    runs = [tuple(r.split("/")) for r in args.runs.split(",")] if args.runs else RUNS
    loss = "" if args.loss == "plain" else f"_loss-{args.loss}"
    out = Path(args.out_dir) / f"forecast_fake_{args.engine}-{world}{loss}_cpu_{datetime.date.today():%Y%m%d}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for name in args.models.split(","):
        spec = resolve(name=name)
        for (micro_batch, seq_len), (recompute, precision) in ((shape, run) for shape in shapes for run in runs):
            recipe = Recipe(
                engine=args.engine,
                world=world,
                device="cpu",
                precision=precision,
                micro_batch=micro_batch,
                seq_len=seq_len,
                recompute=(recompute,) * spec.layers,
                loss=args.loss,
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
            print(table(rows[-1:]), end="", flush=True)
            text = table(rows, engine=args.engine, world=world, loss=args.loss)
            write_atomic(out, lambda f, text=text: f.write(text.encode()))
    print(out.read_text())


def table(rows: list[dict], *, engine: str | None = None, world: int = 1, loss: str = "plain") -> str:
    """Markdown: forecast beside MemTracker's peak on fake tensors, with the error and where the peak is; with
    ``engine``, the whole table (title, header, summary), else the rows alone."""
    header = engine is not None
    lines = []
    if header:
        what = "one process" if engine == "torch" else f"rank 0 of {world} on a fake process group"
        lines += [
            f"# Forecast vs MemTracker on a full-size fake step (CPU, torch {torch.__version__}, transformers "
            f"{transformers.__version__})",
            "",
            f"`python benchmarks/forecast_fake.py --engine {engine} --world {world} --loss {loss}`: {engine} engine,"
            f" {what}, AdamW (single-tensor, as on CPU), sdpa, {loss} loss.",
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
