"""ljperf's measured step time against a bare hand-written training loop on the same model, side by side.

Run: ``.venv/bin/python benchmarks/overhead.py [--model llama-tiny] [--micro-batch 4] [--seq-len 256] [--repeat 3]``

Both run in this process, interleaved (bare, ljperf, bare, ljperf, …) so machine drift hits both alike.
The bare loop is the minimum: HF model, AdamW, forward, backward, step, zero_grad, timed per step.
Prints each pair and the median ratio ljperf / bare (target ≤ 1.03).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ljperf import cli, models
from ljperf.result import read_json


def bare_loop(name: str, *, micro_batch: int, seq_len: int, warmup: int, steps: int) -> float:
    """Median step time (s) of the plainest training loop over the same model and token shape."""
    spec = models.resolve(name=name)
    model = models.materialize(models.build_meta(spec), device=torch.device("cpu"), seed=0)
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
    return statistics.median(times)


def ljperf_run(name: str, *, micro_batch: int, seq_len: int, warmup: int, steps: int) -> float:
    """Median step time (s) that ``ljperf benchmark`` measures for the same work."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        argv = ["benchmark", "--model", f"torch/{name}", "--micro-batch", str(micro_batch), "--seq-len", str(seq_len)]
        argv += ["--warmup", str(warmup), "--steps", str(steps), "--output", str(out)]
        if cli.main(argv) != 0:
            raise SystemExit("ljperf benchmark failed")
        return read_json(out)["results"]["step_time_s_p50"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = dict(micro_batch=args.micro_batch, seq_len=args.seq_len, warmup=args.warmup, steps=args.steps)
    ratios = []
    print(f"model {args.model}, micro batch {args.micro_batch}, seq {args.seq_len}, {args.steps} steps, CPU")
    print(f"{'repeat':>6} {'bare ms':>10} {'ljperf ms':>10} {'ratio':>7}")
    for i in range(args.repeat):
        bare = bare_loop(args.model, **work)
        ours = ljperf_run(args.model, **work)
        ratios.append(ours / bare)
        print(f"{i + 1:>6} {bare * 1e3:>10.2f} {ours * 1e3:>10.2f} {ours / bare:>7.3f}")
    print(f"median ratio ljperf / bare: {statistics.median(ratios):.3f} (target ≤ 1.03)")


if __name__ == "__main__":
    main()
