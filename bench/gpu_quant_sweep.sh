#!/usr/bin/env bash
# One device call (run tool), <= 4 minutes on one H200: every quantized-product kernel variant x
# config (int4-g128, int8 per channel, fp8; the CUDA-core GEMVs incl. the one-row lean and half2 GEMVs
# (one LOP3 / PRMT + one FFMA per code; two codes per HFMA2), the split-K dot, the fused
# tensor-core "mma" kernel with / without swapped operands, planes / reshape, split-K; fp8
# weight-only GEMV with bf16 / fp16 dots and W8A8) on the Llama-3.1-8B layer products at 1, 2, 4,
# 8, 16, 64, 256 rows beside bf16. Each config is checked against the float reference (layer 0's
# weights) and timed over 8 layers in a CUDA graph. Prints the best config per (kind, rows,
# product), the layer's us, fraction of copy bandwidth, ratio to bf16 and the issue-13 target;
# writes $OUT/<date>-<gpu>-quant-sweep-llama-3.1-8b.json (every timing) and $OUT/quant-plans.json
# (the winners as plan-table entries: KVFLEET_QUANT_PLANS=$OUT/quant-plans.json uses them).
#   bench/gpu_quant_sweep.sh            ROWS=1,16 LAYERS=8 WORKERS=12 KINDS=fp8 override the defaults
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-quant-sweep}
mkdir -p "$OUT"
source bench/device_env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kvfleet-triton-cache}  # shared by the compile workers
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
echo "=== sweep ($(date +%T))"
timeout -k 5 "${SWEEP_TIMEOUT:-230}" $PY -m kvfleet_engine.bench.quant_sweep \
  --rows "${ROWS:-1,2,4,8,16,64,256}" --layers "${LAYERS:-8}" --workers "${WORKERS:-12}" \
  --kinds "${KINDS:-bf16,int4,int8,fp8}" \
  --output-dir "$OUT" 2>&1 | grep -v Warning | tee "$OUT/quant_sweep.log"
echo "=== done ($(date +%T))"
