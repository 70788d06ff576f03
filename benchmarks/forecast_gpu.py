"""python benchmarks/forecast_gpu.py [--device cuda] [--models llama3.2-1b,llama3.2-3b] [--out FILE.md]

Forecast vs measured peak memory of a real training step, side by side: for each model and shape, the torch
engine (bf16-mixed, AdamW foreach, sdpa) trains three steps and ``torch.cuda.max_memory_allocated`` of step 3
(the steady state) is compared with ``ljperf.forecast`` (uncalibrated defaults). Writes a markdown table
(default ``benchmarks/forecast_gpu.md``) and prints it; the target is within 5%. ``--device cpu`` runs the same
comparison with tiny models and the CPU live-tensor measurement (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ljperf import benchmark, hardware, models
from ljperf.config import LaunchConfig, OptimConfig, TrainConfig
from ljperf.engines.torch_engine import TorchEngine
from ljperf.forecast import Recipe, forecast
from ljperf.runtime import RunContext

SHAPES = ((1, 2048), (2, 2048), (1, 4096))
GiB = 1024**3


def measure(spec: models.ModelSpec, *, device: str, micro_batch: int, seq_len: int, recompute: str) -> int | None:
    """Peak allocated bytes of step 3 (None when it runs out of memory)."""
    precision = "bf16-mixed" if device == "cuda" else "fp32"
    train = TrainConfig(micro_batch=micro_batch, seq_len=seq_len, precision=precision, device=device)
    optim = OptimConfig(recompute=recompute)
    run = RunContext(engine="torch", model=spec, train=train, launch=LaunchConfig(), optim=optim)
    run.device = hardware.local_device(device, 0)
    engine = TorchEngine(run)
    try:
        engine.setup(models.build_meta(spec, attn_implementation="sdpa"))
        tokens = [torch.randint(0, spec.vocab, (micro_batch, seq_len), device=run.device.torch_device)]
        for _ in range(2):
            engine.train_step(tokens)
        state = benchmark.LoopState()
        benchmark.measured_memory_step(run, engine, tokens, state)
        if device == "cuda":
            return torch.cuda.max_memory_allocated(run.device.torch_device)
        return state.peak_allocated
    except torch.OutOfMemoryError:
        return None
    finally:
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--models", default=None, help="comma-separated catalog names")
    parser.add_argument("--recompute", default="none", help="none or full")
    parser.add_argument("--out", default="benchmarks/forecast_gpu.md")
    args = parser.parse_args()
    names = (args.models or ("llama3.2-1b,llama3.2-3b" if args.device == "cuda" else "llama-tiny,qwen3-tiny")).split(
        ","
    )
    shapes = SHAPES if args.device == "cuda" else ((1, 128), (2, 256))
    device_name = hardware.local_device(args.device, 0).name
    rows = []
    for name in names:
        spec = models.resolve(name=name)
        for micro_batch, seq_len in shapes:
            recipe = Recipe(
                device=args.device,
                precision="bf16-mixed" if args.device == "cuda" else "fp32",
                micro_batch=micro_batch,
                seq_len=seq_len,
                recompute=(args.recompute,) * spec.layers,
            )
            start = time.perf_counter()
            predicted = forecast(spec, recipe, device_name=device_name)
            seconds = time.perf_counter() - start
            measured = measure(
                spec, device=args.device, micro_batch=micro_batch, seq_len=seq_len, recompute=args.recompute
            )
            error = None if measured is None else 100 * (predicted.peak_allocated_bytes - measured) / measured
            rows.append((name, micro_batch, seq_len, predicted.peak_allocated_bytes, measured, error, seconds))
            print(rows[-1], flush=True)
    lines = [
        f"# Memory forecast vs measured peak ({device_name}, torch {torch.__version__}, recompute {args.recompute})",
        "",
        "| model | micro batch | seq len | forecast GiB | measured GiB | error % | forecast s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, b, s, pred, meas, err, sec in rows:
        shown = "OOM" if meas is None else f"{meas / GiB:.3f}"
        err_text = "-" if err is None else f"{err:+.1f}"
        lines.append(f"| {name} | {b} | {s} | {pred / GiB:.3f} | {shown} | {err_text} | {sec:.1f} |")
    errors = [abs(r[5]) for r in rows if r[5] is not None]
    if errors:
        lines += ["", f"max |error| {max(errors):.1f}% over {len(errors)} runs (target: within 5%)"]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
