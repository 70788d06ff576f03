#!/usr/bin/env bash
# bash benchmarks/ablation-llama3.2-1b-gpu.sh [OUT]   (one CUDA GPU; about 12 runs of a few minutes each)
# The GPU ablation: Base → +compile → +compile+ckpt, and full recompute, 3 interleaved repeats.
# Not yet run by the project: no GPU figures are claimed for it. Re-render with: ljperf report OUT
set -euo pipefail
out="${1:-benchmarks/ablation-llama3.2-1b-gpu}"
# Without a budget auto recomputes nothing on a large GPU (the job fits), and compile+ckpt would be compile.
# ljperf plan --gpu H200-141GB forecasts 41.4 GiB without recompute and 28.0 GiB with full: 35 GiB is between.
export LJPERF_MEMORY_BUDGET="${LJPERF_MEMORY_BUDGET:-35GiB}"
exec ljperf ablation --model torch/llama3.2-1b --device cuda \
    --variants base,compile,compile+ckpt,ckpt-full --repeat 3 \
    --micro-batch 2 --seq-len 4096 --steps 20 --warmup 5 --run-timeout 1800 --out "$out"
