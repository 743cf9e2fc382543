#!/usr/bin/env bash
# Device calls (run tool) for the int8 KV cache (`kv_cache_dtype="int8"`) beside the fp8 one.
# The SmolLM2 GGUF (94 MiB) the accuracy step needs is larger than one call's 64 MiB transfer,
# so it travels in two halves (`split -n 2 -d` of the file into .xfer/a/part.00 and
# .xfer/b/part.01; .xfer/ is git-ignored locally) over two calls back to back, while the machine
# stays warm:
#   call 1, carry [".xfer/a", ".whl"]:  bench/gpu_kv_int8.sh stage tests kernels
#   call 2, carry [".xfer/b", ".whl"]:  bench/gpu_kv_int8.sh accuracy throughput-1k-int8
# Steps:
#   stage       keep the first half on the machine (/root/kvfleet-xfer)
#   tests       the gpu-marked tests of tests/kernels/test_kv_fp8.py (store, decode, prefill,
#               fused kernels at Llama sizes, e4m3 and int8) and tests/engine/test_kv_cache_quantized.py
#               (both caches in the decode CUDA graphs)
#   kernels     the engine's attention launches over bf16, fp8 and int8 caches (bench.kernels
#               --engine-only): decode 64 x 4k and 512 x 1.5k against copy bandwidth, batch 1
#   accuracy    `kvfleet bench accuracy` on the Q4_1 GGUF: fp8 and int8 KV caches against the
#               GGUF's own (65,536 tokens, 50 chat prompts), bound +0.5%
#   throughput-1k-int8 / -fp8   offline 1000 x (1000 in, 1000 out), bf16 weights, 768 sequences
# Logs and results JSON go to $OUT; STEP_TIMEOUT (seconds, default 400) caps each step.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-kv-int8}
STAGE=/root/kvfleet-xfer
mkdir -p "$OUT"
source bench/device_env.sh
export KVFLEET_CACHE_DIR=/tmp/kvc
PY="timeout -k 5 ${STEP_TIMEOUT:-400} python3"
THROUGHPUT_1K="-m kvfleet_cli.main bench throughput --shape llama-3.1-8b --num-prompts 1000
  --input-len 1000 --output-len 1000 --max-num-batched-tokens 16384 --max-num-seqs 768"
GGUF=$KVFLEET_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    stage) mkdir -p "$STAGE" && cp .xfer/a/part.* "$STAGE"/ && ls -la "$STAGE" ;;
    tests) $PY -m pytest -m gpu tests/kernels/test_kv_fp8.py tests/engine/test_kv_cache_quantized.py \
        -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    kernels)
      for shape in "64 4096" "512 1536"; do
        set -- $shape
        $PY -m kvfleet_engine.bench.kernels --output-dir "$OUT" --engine-only --cases decode \
          --num-seqs "$1" --context "$2" 2>&1 | tee -a "$OUT/kernels.log" | grep -v Warning
      done ;;
    accuracy)
      mkdir -p "$(dirname "$GGUF")"
      cat "$STAGE"/part.* .xfer/b/part.* > "$GGUF" && sha256sum "$GGUF"
      $PY -m kvfleet_cli.main bench accuracy --config "q4_1=$GGUF" \
        --config "fp8kv=$GGUF:kv_cache_dtype=fp8" --config "int8kv=$GGUF:kv_cache_dtype=int8" \
        --bound fp8kv=0.5 --bound int8kv=0.5 --output "$OUT" 2>&1 | tee "$OUT/accuracy.log" \
        | grep -v -i 'warn\|it/s\]' | tail -12 ;;
    throughput-1k-int8|throughput-1k-fp8)
      cache=${step#throughput-1k-}
      $PY $THROUGHPUT_1K --kv-cache-dtype "$cache" --output-dir "$OUT/1k-$cache" 2>&1 \
        | tee "$OUT/throughput-1k-$cache.log" | grep -v 'it/s\]\|req/s\]' | tail -14 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
