#!/usr/bin/env bash
# The GPU run: HW-1 (prefill slope), HW-2 (the engine's paths), HW-5 (first token over HTTP,
# >= 128 observations per path) and HW-6 (energy, from NVML) on CUDA, with random-weight
# Llama timing models of the 1B and 8B class in bf16 (prepos.lab.tiny.TIMING_SIZES: Llama-3.2-1B
# and Llama-3.1-8B shapes). For a GPU host; the CPU suite does not need it.
# Writes $GPU_OUT/<size>/*.json and $GPU_OUT/summary.md; `python benchmarks/report.py` then
# puts the GPU table into docs/RESULTS.md. On one H200 (2026-12-04) the 1b class took 35 s for
# the model and HW-1, 60 s for HW-2 and about 2.2 s an HTTP round of HW-5 (2 x SAMPLES + 8
# rounds), so the defaults need well over 15 minutes; `SIZES=1b SAMPLES=48` finishes within
# about 15 minutes (an estimate from those step times).
#
#   benchmarks/gpu.sh                                              # 1b and 8b on cuda
#   SIZES=test DEVICE=cpu DTYPE=float32 SAMPLES=4 GPU_OUT=/tmp/g benchmarks/gpu.sh  # on a CPU
#
# On a GPU host without internet access that has its own torch and transformers (Python
# 3.12) but not the web stack: run scripts/device_wheels.sh on a machine with access, copy
# the checkout with its .whl/ folder to the host, and there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site && benchmarks/gpu.sh && tar czf gpu.tgz results/gpu
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SIZES=${SIZES:-"1b 8b"}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
SAMPLES=${SAMPLES:-128}  # HW-5 observations per path and mode; HW-2 runs half as many
GPU_OUT=${GPU_OUT:-results/gpu}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
t0=$SECONDS
for size in $SIZES; do
  out=$GPU_OUT/$size
  mkdir -p "$out"
  model=(--size "$size" --device "$DEVICE" --dtype "$DTYPE")
  step() {  # name, script, args...: the script's JSON lands in $out; its output in a log
    local name=$1 script=$2
    shift 2
    echo "[$((SECONDS - t0)) s] $size: $name"
    "$PY" "benchmarks/$script" "${model[@]}" "$@" > "$out/$name.log" 2>&1 \
      || { tail -20 "$out/$name.log"; exit 1; }
  }
  step prefill prefill.py --samples 8 --out "$out/prefill.json"
  step engine_paths engine_paths.py --samples $((SAMPLES / 2)) --update-ms 100 \
    --out "$out/engine_paths.json"
  step http_ttft http_ttft.py --samples "$SAMPLES" --no-load --out "$out/http_ttft.json"
  step energy energy.py --rounds 32 --out "$out/energy.json"
done
echo "[$((SECONDS - t0)) s] done"
"$PY" benchmarks/report.py --gpu-summary "$GPU_OUT"
