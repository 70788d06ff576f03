#!/usr/bin/env bash
# The GPU checks of issues #4–#6 in one device call (one H200, under 10 minutes: each step is time-boxed, and
# every step ends by DEADLINE seconds after the start, 560 by default, so the call's 600 s limit is not hit):
#   here:   bash benchmarks/gpu_wheels.sh
#   device: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
# Smoke test of the script on this CPU machine (tiny models): LJPERF_GPU_SMOKE=1 bash benchmarks/gpu_session.sh
# With the device's versions (PyPI's CUDA build of torch runs on a CPU; about 2 min and 5 GB to install):
#   python3 -m venv /tmp/v211 && /tmp/v211/bin/pip install torch==2.11.0 transformers==5.17.0 accelerate rich \
#       matplotlib && DS_BUILD_OPS=0 /tmp/v211/bin/pip install deepspeed==0.19.8
#   LJPERF_GPU_SMOKE=1 PY=/tmp/v211/bin/python bash benchmarks/gpu_session.sh
#
# Steps, most wanted first (a step that would start with under 20 s left is skipped, and says so). Its first
# run (benchmarks/results/gpu_h200_2026-12-04) measured the llama forecasts, compile and recompute; first now is
# what the fixes since then changed: (1) forecast vs measured for GPT-2 large (tanh GELU, attention dropout) and a
# dense MLA model (narrower value heads), whose CUDA forecast assumes the fused SDPA kernel; (2) the startup
# hook's plan and closed loop in an HF Trainer script (its [ljperf] lines in session.log; fp32 GQA attention, on
# CUDA's math path), with a cache of its own (no calibration fitted on 1B models applied to its tiny one);
# (3) FSDP2 and ZeRO-3 bf16 benchmark runs of llama3.2-1b and a ZeRO-2 one with accumulation, whose records hold
# forecast vs measured; (4) regional vs DeepSpeed's engine.compile() (DeepCompile when its op builds) under
# ZeRO-3; then again (5) forecast vs torch.cuda.max_memory_allocated for llama3.2-1b/3b
# (benchmarks/forecast_gpu.py) and the calibration fitted from those records; (6) eager vs regional compile,
# torch engine, llama3.2-3b (target ≥ 1.20× tokens/s; 1b: 1.38×); (7) the auto recompute plan vs its neighbours
# on the solver's staircase and auto's own run (benchmarks/recompute.py --plans near). Every table is rewritten
# after each of its runs.
# A rerun of some steps only (after a cut): ONLY="compile-deepspeed forecast-fused" bash benchmarks/gpu_session.sh
# Issue #38, ljperf against its peers (benchmarks/peers.py; last, about 4 minutes): ONLY="peers-1b peers-3b".
# Everything lands in $OUT (the device's return folder; default benchmarks/results/gpu_session): at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu_session}"
WORK="$(mktemp -d /tmp/ljperf-gpu-XXXX)"
DEADLINE="${DEADLINE:-560}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LJPERF_CACHE_DIR="$WORK/cache" PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${LJPERF_GPU_SMOKE:-}" ]; then
    PY="${PY:-.venv/bin/python}" DEVICE=cpu MODEL=llama-tiny MODELS=llama-tiny SEQ=128 MB=2 NPROC=2 SCALE=3
    COMPILE_MODEL=llama-tiny PEERS_3B=llama-tiny MB_3B=2
    HOOK_MB=4 DEADLINE="${DEADLINE_SMOKE:-1500}" FUSED_MODELS=llama-tiny FUSED_SHAPES=1x64
else
    PY=python3 DEVICE=cuda MODEL=llama3.2-1b MODELS=llama3.2-1b,llama3.2-3b SEQ=2048 MB=4 NPROC=1 SCALE=1
    COMPILE_MODEL=llama3.2-3b PEERS_3B=llama3.2-3b MB_3B=2
    HOOK_MB=64 # 16k tokens a step: activations of hundreds of MiB, beside the device's fixed overheads
    FUSED_MODELS=benchmarks/configs/gpt2-large.json,benchmarks/configs/deepseek-mla-1b.json FUSED_SHAPES=1x1024,4x1024
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/session.log"
    echo "ljperf at $(cat .whl/REVISION 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)" >>"$OUT/session.log"
    "$PY" -c "import deepspeed, torch, transformers; print('deepspeed', deepspeed.__version__, 'torch', \
torch.__version__, 'transformers', transformers.__version__)" >>"$OUT/session.log" 2>&1
fi
wanted() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
step() { # step NAME SECONDS COMMAND...: run with a time limit (never past DEADLINE), log it, go on whatever happens
    local name=$1 limit=$(($2 * SCALE)) left=$((DEADLINE - SECONDS))
    shift 2
    wanted "$name" || return 0
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        echo "== $name skipped: ${left}s left of ${DEADLINE}s" | tee -a "$OUT/session.log"
        return
    fi
    echo "== $name (at ${SECONDS}s, limit ${limit}s): $*" | tee -a "$OUT/session.log"
    timeout "$limit" "$@" >>"$OUT/session.log" 2>&1
    echo "== $name exit $? (at ${SECONDS}s)" | tee -a "$OUT/session.log"
}

# What the fixes after the first session (2026-12-04) changed, first: GPT-2's tanh GELU in fp32 and MLA's fused
# attention (cut by the deadline then), the hook's fp32 GQA attention on the math path, ZeRO-3's sub-groups.
step forecast-fused 150 "$PY" benchmarks/forecast_gpu.py --device "$DEVICE" --models "$FUSED_MODELS" \
    --shapes "$FUSED_SHAPES" --out-dir "$WORK/forecast-fused"
cp "$WORK"/forecast-fused/forecast_*.md "$OUT/forecast_fused.md" 2>/dev/null

# The startup hook's plan and closed loop on this device: the unchanged HF Trainer test script under
# CHECKPOINT_OPTIMIZATION (installed as ljperf_startup.pth would), budget half-way between no and full recompute,
# with the default (uncalibrated) overheads of a cache of its own.
export HOOK_SCRIPT_MICRO_BATCH="$HOOK_MB"
if ! wanted hook; then
    :
elif [ $((DEADLINE - SECONDS)) -gt 60 ]; then # the budget takes a forecast of its own (about 10 s)
    budget=$(LJPERF_CACHE_DIR="$WORK/hook-cache" "$PY" - "$DEVICE" <<'PY'
import sys
sys.path.insert(0, "tests/scripts")
import torch
from tiny_llama import CONFIG, MICRO_BATCH, SEQ_LEN
from ljperf.forecast import Recipe, forecast
from ljperf.core.hardware import calibration_name
from ljperf.models.spec import ModelSpec, hf_config
device = sys.argv[1]
spec = ModelSpec.of(hf_config(CONFIG, source="gpu_session"), name="script")
recipe = Recipe(device=device, precision="fp32", micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, optimizer="fused")
name = calibration_name(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
none, full = (forecast(spec, recipe.with_(recompute=(m,) * spec.layers), device_name=name).device_bytes for m in ("none", "full"))
print((none + full) // 2)
PY
    )
    echo "hook budget $budget bytes (micro batch $HOOK_MB)" >>"$OUT/session.log"
    step hook 60 env LJPERF_CACHE_DIR="$WORK/hook-cache" CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET="$budget" \
        HOOK_SCRIPT_DEVICE="$DEVICE" "$PY" -c \
        "import runpy, sys; sys.path.insert(0, 'tests/scripts'); from ljperf.startup_hooks.install import install; install();
sys.argv = ['hf_trainer.py', '$WORK/hook']; runpy.run_path('tests/scripts/hf_trainer.py', run_name='__main__')"
else
    echo "== hook skipped: $((DEADLINE - SECONDS))s left of ${DEADLINE}s" | tee -a "$OUT/session.log"
fi

for engine in fsdp deepspeed; do
    step "$engine-forecast" 60 "$PY" -m ljperf benchmark --model "$engine/$MODEL" --device "$DEVICE" \
        --nproc-per-node "$NPROC" --micro-batch 1 --seq-len "$SEQ" --steps 2 --warmup 2 \
        --output "$WORK/bench-$engine.json"
done
# ZeRO-2 with accumulation: two gradient partitions alive in micro-step 2 and the bucket's flat copy, so far
# measured on gloo only (docs/forecast.md, Limits)
step zero2-forecast 60 "$PY" -m ljperf benchmark --model "deepspeed/$MODEL" --zero-stage 2 --grad-accum 2 \
    --device "$DEVICE" --nproc-per-node "$NPROC" --micro-batch 1 --seq-len "$SEQ" --steps 2 --warmup 2 \
    --output "$WORK/bench-zero2.json"
"$PY" - "$WORK"/bench-*.json >"$OUT/engines.jsonl" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except (OSError, ValueError) as exc:
        print(json.dumps({"record": path, "error": str(exc)}))
        continue
    r, f = d["results"], d["results"].get("forecast") or {}
    e = d["config"]["engine"]
    t = d["config"]["train"]
    print(json.dumps({"engine": e["name"], "zero_stage": e.get("zero_stage"), "precision": t["precision"],
                      "grad_accum": t["grad_accum"],
                      "status": r["status"], "measured": r["peak_allocated_bytes"],
                      "forecast": f.get("peak_allocated_bytes"), "traced": f.get("traced_peak_allocated_bytes"),
                      "error_pct": f.get("error_pct"), "phase": f.get("phase"), "tokens_per_s": r["tokens_per_s"],
                      "mfu": r.get("mfu")}))
PY

# Regional vs DeepCompile under ZeRO-3 (its table keeps the modes that finished).
# The deepspeed mode warms up 6 steps itself (DeepCompile compiles again at step 5) and builds its C++ op first.
step compile-deepspeed 150 "$PY" benchmarks/compile.py --device "$DEVICE" --model "deepspeed/$MODEL" \
    --seq-len "$SEQ" --micro-batch "$MB" --steps 6 --warmup 7 --modes regional,deepspeed \
    --markdown "$OUT/compile_deepspeed.md" -- --nproc-per-node "$NPROC"
# Measured within 0.01% on 2026-12-04; again, and last, as the deadline may cut them.
step forecast 120 "$PY" benchmarks/forecast_gpu.py --device "$DEVICE" --models "$MODELS" --out-dir "$WORK/forecast"
cp "$WORK"/forecast/forecast_*.md "$OUT/forecast.md" 2>/dev/null
step calibrate 30 "$PY" -m ljperf plan --calibrate "$WORK"/forecast/forecast_*/*.json
tar -czf "$OUT/forecast_records.tar.gz" -C "$WORK/forecast" . 2>/dev/null

step compile-torch 150 "$PY" benchmarks/compile.py --device "$DEVICE" --model "torch/$COMPILE_MODEL" \
    --seq-len "$SEQ" --micro-batch "$MB" --steps 8 --warmup 3 --modes off,regional --markdown "$OUT/compile_torch.md"
# Auto against the oracle under the half-way budget: auto's plan, its neighbours on the staircase (one full layer
# fewer and one more, each with the fewest selective layers that fit) and --recompute auto itself, one round.
step recompute 180 "$PY" benchmarks/recompute.py --device "$DEVICE" --model "$MODEL" --micro-batch "$MB" \
    --seq-len "$SEQ" --fractions 0.5 --plans near --rounds 1 --steps 3 --out "$OUT/recompute.md"

# ljperf vs the HF Trainer (eager, torch_compile), torchtitan (where .whl carried it and it imports) and ljperf
# eager and --compile, most wanted first; the table is written after every peer, so a cut keeps those before it.
step peers-1b 150 "$PY" benchmarks/peers.py --device "$DEVICE" --model "$MODEL" --micro-batch "$MB" --seq-len "$SEQ" \
    --steps 5 --warmup 3 --timeout $((75 * SCALE)) --peers trainer,ljperf,trainer-compile,ljperf-compile,torchtitan \
    --out "$WORK/peers-1b"
step peers-3b 110 "$PY" benchmarks/peers.py --device "$DEVICE" --model "$PEERS_3B" --micro-batch "$MB_3B" \
    --seq-len "$SEQ" --steps 5 --warmup 3 --timeout $((60 * SCALE)) --peers trainer,ljperf,ljperf-compile --out "$WORK/peers-3b"
cat "$WORK"/peers-*/peers.json >>"$OUT/session.log" 2>/dev/null # the tables are there already: no ninth file

# The engines' own cost on one device (#38 item 5): every engine at the torch engine's shape, eager; the compiled
# half with ONLY=engines-compiled when time allows.
step engines 150 "$PY" benchmarks/engines.py --device "$DEVICE" --model "$MODEL" --micro-batch "$MB" --seq-len "$SEQ" \
    --nproc-per-node 1 --steps 5 --compile off --out "$WORK/engines.md"
step engines-compiled 200 "$PY" benchmarks/engines.py --device "$DEVICE" --model "$MODEL" --micro-batch "$MB" \
    --seq-len "$SEQ" --nproc-per-node 1 --steps 5 --compile on --out "$WORK/engines-compiled.md"
cat "$WORK"/engines*.md >>"$OUT/session.log" 2>/dev/null

echo "== done at ${SECONDS}s" | tee -a "$OUT/session.log"
ls -l "$OUT"
