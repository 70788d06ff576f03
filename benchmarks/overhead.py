"""ljperf's measured step time against a bare hand-written training loop on the same model, side by side.

Run: ``.venv/bin/python benchmarks/overhead.py [--model llama-tiny] [--micro-batch 4] [--seq-len 256] [--repeat 3]``

Both run in this process, interleaved (bare, ljperf, bare, ljperf, …) so machine drift hits both alike.
The bare loop is the minimum: HF model, AdamW, forward, backward, step, zero_grad, timed per step.
Prints each pair and two ratios ljperf / bare (target ≤ 1.03): of the median step times (median over
repeats), and of the fastest step seen by each (robust when other jobs share the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ljperf import cli
from ljperf.core.records import read_json
from ljperf.models.build import materialize
from ljperf.models.spec import build_meta, resolve


def bare_loop(name: str, *, micro_batch: int, seq_len: int, warmup: int, steps: int, threads: int) -> list[float]:
    """Step times (s) of the plainest training loop over the same model and token shape."""
    torch.set_num_threads(threads)  # as ljperf's --threads does for its run
    spec = resolve(name=name)
    model = materialize(build_meta(spec), device=torch.device("cpu"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    times = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, spec.vocab, (micro_batch, seq_len), generator=gen)
        start = time.perf_counter()
        model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def ljperf_run(name: str, *, micro_batch: int, seq_len: int, warmup: int, steps: int, threads: int) -> list[float]:
    """Step times (s) that ``ljperf benchmark`` measures for the same work."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        argv = ["benchmark", "--model", f"torch/{name}", "--micro-batch", str(micro_batch), "--seq-len", str(seq_len)]
        argv += ["--warmup", str(warmup), "--steps", str(steps), "--device", "cpu", "--threads", str(threads)]
        argv += ["--output", str(out)]
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown):  # its own table: only the step times are compared here
            code = cli.main(argv)
        if code != 0:
            raise SystemExit(f"ljperf benchmark failed (exit {code}):\n{shown.getvalue()}")
        return read_json(out)["results"]["step_times_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of both loops (default: 1)")
    args = parser.parse_args()
    work = dict(
        micro_batch=args.micro_batch, seq_len=args.seq_len, warmup=args.warmup, steps=args.steps, threads=args.threads
    )
    ratios, bare_all, ours_all = [], [], []
    print(f"model {args.model}, micro batch {args.micro_batch}, seq {args.seq_len}, {args.steps} steps, CPU", end=" ")
    print(f"({args.threads} thread(s) in both)")
    print(f"{'repeat':>6} {'bare p50 ms':>12} {'ljperf p50 ms':>14} {'ratio':>7}")
    for i in range(args.repeat):
        bare = bare_loop(args.model, **work)
        ours = ljperf_run(args.model, **work)
        bare_all += bare
        ours_all += ours
        ratio = statistics.median(ours) / statistics.median(bare)
        ratios.append(ratio)
        print(f"{i + 1:>6} {statistics.median(bare) * 1e3:>12.2f} {statistics.median(ours) * 1e3:>14.2f} {ratio:>7.3f}")
    print(f"median of p50 ratios ljperf / bare: {statistics.median(ratios):.3f} (target ≤ 1.03)")
    fastest_bare, fastest_ours = min(bare_all), min(ours_all)
    print(f"fastest step: bare {fastest_bare * 1e3:.2f} ms, ljperf {fastest_ours * 1e3:.2f} ms,", end=" ")
    print(f"ratio {fastest_ours / fastest_bare:.3f}")


if __name__ == "__main__":
    main()
