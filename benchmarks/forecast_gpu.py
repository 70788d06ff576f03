"""python benchmarks/forecast_gpu.py [--device cuda|cpu] [--models llama3.2-1b,llama3.2-3b] [--shapes 1x2048,...]
[--out-dir DIR]

Forecast vs measured peak memory of a real training step, side by side. For each model and shape the torch
engine (bf16-mixed, AdamW foreach, sdpa) trains three steps and ``torch.cuda.max_memory_allocated`` of step 3
(the steady state) is compared with ``ljperf.forecast``: the traced figure and the one with the uncalibrated
CUDA defaults (cuBLAS workspace offset). Target: within 5%. One H200: about 2 minutes (2 models × 3 shapes,
coefficients traced on the CPU once per model and shape family).

Writes to ``--out-dir`` (default ``benchmarks/results``): ``forecast_<device>_<date>.md`` (the table, versions)
and ``forecast_<device>_<date>/*.json``, one record per run that ``ljperf plan --calibrate DIR/*.json`` fits the
device overheads from. ``--device cpu`` runs the same comparison with tiny models in fp32 and the CPU
live-tensor measurement: an end-to-end check of the script on a machine without a GPU.

``--models`` also takes config.json paths: ``benchmarks/configs`` has GPT-2 large (attention dropout) and a dense
DeepSeek-V2-Lite-shaped MLA model (value heads narrower than query heads), the two kinds of attention whose CUDA
forecast assumes the fused kernel CPU's SDPA does not run (``--shapes 1x1024,4x1024``). A run that fails is a
row with its error, not the end of the table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ljperf.benchmark.loop import measured_memory_step
from ljperf.core import hardware
from ljperf.core.errors import describe
from ljperf.core.options import OptimizationConfig, TrainConfig
from ljperf.core.records import environment, write_atomic, write_json
from ljperf.distributed.runtime import Process
from ljperf.engines.torch_engine import TorchEngine
from ljperf.forecast import Recipe, forecast
from ljperf.models.spec import build_meta, resolve
from ljperf.run.config import RunConfig, fixed_recompute
from ljperf.run.context import RunContext

SHAPES = {"cuda": ((1, 2048), (2, 2048), (1, 4096)), "cpu": ((1, 128), (2, 256))}
MODELS = {"cuda": "llama3.2-1b,llama3.2-3b", "cpu": "llama-tiny,qwen3-tiny"}
GiB = 1024**3


def measure(run: RunContext) -> tuple[int, int | None] | None:
    """(peak allocated, peak reserved) bytes of step 3; None when it runs out of memory."""
    spec, train = run.model, run.train
    device = run.device.torch_device
    engine = TorchEngine(run)
    try:
        engine.setup(build_meta(spec, attn_implementation=train.attn_implementation))
        tokens = [torch.randint(0, spec.vocab, (train.micro_batch, train.seq_len), device=device)]
        for _ in range(2):
            engine.train_step(tokens)
        _, stats = measured_memory_step(run, engine, tokens)
        return stats.peak_allocated, stats.peak_reserved
    except torch.OutOfMemoryError:
        return None
    finally:
        del engine
        gc.collect()
        if device.type == "cuda":
            # cuBLAS keeps a workspace per thread's handle in the caching allocator: freed only on request
            getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
            torch.cuda.empty_cache()
            leftover = torch.cuda.memory_allocated(device)
            if leftover > 64 * 1024**2:  # a leak would lift the next run's peak: say so, keep measuring
                print(f"warning: {leftover} bytes still allocated after the run", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--models", help=f"comma-separated catalog names (default: {MODELS['cuda']} on cuda, {MODELS['cpu']} on cpu)"
    )
    parser.add_argument(
        "--shapes",
        help="comma-separated MICRO_BATCHxSEQ_LEN (default: 1x2048,2x2048,1x4096 on cuda, 1x128,2x256 on cpu)",
    )
    parser.add_argument("--recompute", choices=("none", "full"), default="none")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    info = hardware.local_device(args.device, 0)
    precision = "bf16-mixed" if args.device == "cuda" else "fp32"
    slug = "cpu" if args.device == "cpu" else re.sub(r"[^A-Za-z0-9]+", "-", info.name).strip("-")
    stamp = f"forecast_{slug}_{datetime.date.today():%Y%m%d}"
    out_dir = Path(args.out_dir)
    env = environment(devices=[info.name], world_size=1)
    (out_dir / stamp).mkdir(parents=True, exist_ok=True)
    title = f"{info.name}, torch {torch.__version__}, {precision}, recompute {args.recompute}"
    rows: list[dict] = []
    failures: list[str] = []
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES[args.device]
    specs = {  # all resolved before the first run: a misspelt one stops the script at once
        Path(entry).stem if entry.endswith(".json") else entry: (
            resolve(path=entry) if entry.endswith(".json") else resolve(name=entry)
        )
        for entry in (args.models or MODELS[args.device]).split(",")
    }
    for name, spec in specs.items():
        for micro_batch, seq_len in shapes:
            recipe = Recipe(
                device=args.device,
                precision=precision,
                micro_batch=micro_batch,
                seq_len=seq_len,
                recompute=(args.recompute,) * spec.layers,
            )
            start = time.perf_counter()
            try:
                predicted = forecast(spec, recipe, device_name=info.name)
                seconds = time.perf_counter() - start
                train = TrainConfig(micro_batch=micro_batch, seq_len=seq_len, precision=precision, device=args.device)
                cfg = RunConfig(
                    engine="torch", model=spec, train=train, optim=OptimizationConfig(recompute=args.recompute)
                )
                run = RunContext(config=cfg, process=Process(device=info), plan=fixed_recompute(cfg))
                measured = measure(run)
            except Exception as exc:  # one model's failure (a kernel, a trace) is a row; the others still run
                failures.append(f"{name} {micro_batch}x{seq_len}: {describe(exc)}")
                print(failures[-1], flush=True)
                write_atomic(out_dir / f"{stamp}.md", lambda f: f.write(table(rows, failures, title=title).encode()))
                continue
            row = {
                "model": name,
                "micro_batch": micro_batch,
                "seq_len": seq_len,
                "traced_bytes": predicted.traced_peak_bytes,
                "forecast_bytes": predicted.peak_allocated_bytes,
                "forecast_reserved_bytes": predicted.peak_reserved_bytes,
                "measured_bytes": measured and measured[0],
                "measured_reserved_bytes": measured and measured[1],
                "forecast_seconds": round(seconds, 2),
            }
            rows.append(row)
            print(row, flush=True)
            if measured is not None:  # a record ljperf plan --calibrate reads
                record = {
                    "kind": "forecast_gpu",
                    "env": env,
                    "config": {"model": {"name": name}, "train": {"device": args.device}, "recipe": asdict(recipe)},
                    "results": {
                        "status": "ok",
                        "peak_allocated_bytes": measured[0],
                        "peak_reserved_bytes": measured[1],
                        "forecast": {"traced_peak_allocated_bytes": predicted.traced_peak_bytes},
                    },
                }
                write_json(out_dir / stamp / f"{name}-b{micro_batch}-s{seq_len}.json", record)
            write_atomic(
                out_dir / f"{stamp}.md", lambda f: f.write(table(rows, failures, title=title).encode())
            )  # after every run: partial results stay
    print((out_dir / f"{stamp}.md").read_text())


def table(rows: list[dict], failures: list[str], *, title: str) -> str:
    """Markdown: traced and default-overhead forecasts beside the measured peak, with the error of each."""

    def pct(pred: int, meas: int | None) -> str:
        return "-" if meas is None else f"{100 * (pred - meas) / meas:+.1f}"

    lines = [
        f"# Memory forecast vs measured peak ({title})",
        "",
        "| model | micro batch | seq len | traced GiB | error % | forecast GiB | error % | measured GiB | "
        "reserved GiB (forecast / measured) | forecast s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        meas = r["measured_bytes"]
        reserved = " / ".join(
            "-" if v is None else f"{v / GiB:.2f}" for v in (r["forecast_reserved_bytes"], r["measured_reserved_bytes"])
        )
        lines.append(
            f"| {r['model']} | {r['micro_batch']} | {r['seq_len']} | {r['traced_bytes'] / GiB:.3f} | "
            f"{pct(r['traced_bytes'], meas)} | {r['forecast_bytes'] / GiB:.3f} | {pct(r['forecast_bytes'], meas)} | "
            f"{'OOM' if meas is None else f'{meas / GiB:.3f}'} | {reserved} | {r['forecast_seconds']:.1f} |"
        )
    errors = [abs(r["forecast_bytes"] - r["measured_bytes"]) / r["measured_bytes"] for r in rows if r["measured_bytes"]]
    if errors:
        lines += ["", f"max |error| of the forecast {100 * max(errors):.1f}% over {len(errors)} runs (target: 5%)"]
    lines += ["", *(f"failed: {f}" for f in failures)] if failures else []
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
