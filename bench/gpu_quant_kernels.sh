#!/usr/bin/env bash
# One device call (run tool), <= 6 minutes: the gpu-marked quantized-matmul tests (int4/int8/fp8 on
# the Llama-3.1-8B products, in a CUDA graph), then bench.quant_gemv: per-layer times, GB/s and
# fraction of copy bandwidth for bf16 / int8 / int4 / fp8 at 1, 4, 16, 256 rows and the plans the
# shape tables pick (the candidates they choose from: bench/gpu_quant_sweep.sh). Logs and JSON go
# to $OUT.
#   bench/gpu_quant_kernels.sh [tests] [bench]
# TOKENS / LAYERS override the benchmark's rows and layer count.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-quant}
mkdir -p "$OUT"
source bench/device_env.sh
PY=${PY:-python3}
STEPS=${*:-tests bench}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
for step in $STEPS; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests) timeout -k 5 "${TESTS_TIMEOUT:-150}" $PY -m pytest -m gpu tests/kernels/test_quant_matmul.py \
        -q -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/tests.log" | grep -v Warning | tail -40 ;;
    bench) timeout -k 5 "${BENCH_TIMEOUT:-300}" $PY -m kvfleet_engine.bench.quant_gemv \
        --tokens "${TOKENS:-1,4,16,256}" \
        --layers "${LAYERS:-8}" --output-dir "$OUT" 2>&1 | tee "$OUT/quant_gemv.log" | grep -v Warning ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
