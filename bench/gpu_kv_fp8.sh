#!/usr/bin/env bash
# One device call (run tool), about 5 minutes: the fp8 KV cache on the GPU. Steps default to
# `tests kernels`; pass a subset or add the offline 1k/1k pair (each run ~4 min, one call each):
#   bench/gpu_kv_fp8.sh tests kernels
#   bench/gpu_kv_fp8.sh throughput-1k-bf16      then      bench/gpu_kv_fp8.sh throughput-1k-fp8
# throughput-1k-fp8 runs the weights in QUANTS (default none; QUANTS=none,fp8 adds fp8 weights
# over the fp8 cache in the same process, the TensorRT-LLM comparison).
# tests: the gpu-marked tests of tests/kernels/test_kv_fp8.py (store, decode, prefill, fused
# kernels at Llama sizes against the dequantized reference) and tests/engine/test_kv_cache_quantized.py
# (the fp8 cache in the decode CUDA graphs). kernels: the attention microbenchmark over a bf16 and an
# fp8 cache (decode 64 x 4k GB/s against copy bandwidth, batch-1 decode, prefill). Logs and
# results JSON go to $OUT; STEP_TIMEOUT (seconds, default 590) caps each step.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-kv-fp8}
mkdir -p "$OUT"
source bench/device_env.sh
PY="timeout -k 5 ${STEP_TIMEOUT:-590} ${PY:-python3}"
STEPS=${*:-tests kernels}
# The 1k/1k pair: the fp8 cache holds ~2x the tokens, so it may run ~2x the sequences.
THROUGHPUT_1K="-m kvfleet_cli.main bench throughput --shape ${SHAPE:-llama-3.1-8b} --num-prompts 1000
  --input-len 1000 --output-len 1000 --max-num-batched-tokens ${MAX_TOKENS:-16384}"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
for step in $STEPS; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests) $PY -m pytest -m gpu tests/kernels/test_kv_fp8.py tests/engine/test_kv_cache_quantized.py -q \
        -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    kernels) $PY -m kvfleet_engine.bench.kernels --output-dir "$OUT" 2>&1 | tee "$OUT/kernels.log" \
        | grep -v Warning ;;
    throughput-1k-bf16) $PY $THROUGHPUT_1K --max-num-seqs "${MAX_SEQS_BF16:-384}" \
        --output-dir "$OUT/1k-bf16" 2>&1 | tee "$OUT/throughput-1k-bf16.log" \
        | grep -v 'it/s\]\|req/s\]' | tail -20 ;;
    throughput-1k-fp8) $PY $THROUGHPUT_1K --kv-cache-dtype fp8 --quantization "${QUANTS:-none}" \
        --max-num-seqs "${MAX_SEQS_FP8:-768}" \
        --output-dir "$OUT/1k-fp8" 2>&1 | tee "$OUT/throughput-1k-fp8.log" \
        | grep -v 'it/s\]\|req/s\]' | tail -20 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
