#!/usr/bin/env bash
# bash benchmarks/loss.sh [OUT]   (CPU: a 32k-vocabulary tiny Llama, about 15 min on 2 busy cores)
# GPU: MODEL="--model torch/llama3.2-1b" SHAPE="--micro-batch 8 --seq-len 2048" EXTRA="--device cuda" bash benchmarks/loss.sh OUT
# --loss plain vs chunked, eager and under regional compile: 4 variants × 3 interleaved repeats through ljperf
# ablation, which reports median and min–max tokens/s, step time and peak memory. Re-render with: ljperf report OUT
set -euo pipefail
out="${1:-/tmp/ljperf-loss}"
model="${MODEL:---model-config benchmarks/configs/llama-tiny-vocab32k.json}"
shape="${SHAPE:---micro-batch 2 --seq-len 512}"
# shellcheck disable=SC2086  # the variables hold several flags
exec ljperf ablation $model $shape ${EXTRA:-} --variants base,loss-chunked,compile,compile+loss --repeat 3 \
    --steps 8 --warmup 2 --out "$out"
