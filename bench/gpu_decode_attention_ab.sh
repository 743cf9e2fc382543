#!/usr/bin/env bash
# Device calls (run tool) for the attention tile loop of 2026-12-05 (whole tiles without masks,
# one-warp splits in whole waves, lazy rescale), against another tree in the same call:
#   AB_TREE=.ab/old bash bench/gpu_decode_attention_ab.sh tests kernels      # call 1
#   bash bench/gpu_decode_attention_ab.sh throughput-1k-bf16 throughput-1k-fp8kv     # call 2
#   AB_TREE=.ab/old bash bench/gpu_decode_attention_ab.sh throughput-1k-fp8-fp8kv throughput-1k-fp8kv-old
# (.ab/old: `git archive REV engine | tar -x -C .ab/old`, git-ignored, carried; the engine imports
# msgspec, which the device lacks: carry .whl too, with its wheels in .whl/server as
# bench/gpu_serve_core.sh lists them.)
# Steps:
#   tests      gpu-marked kernel tests of decode / prefill / shared-prefix / mixed attention over
#              bf16, fp8 and int8 caches, and the engine's quantized-cache CUDA-graph tests
#   kernels    bench.kernels: decode 64 x 4k (bf16, fp8, int8 caches) and 512 x 1.5k (fp8), each with
#              its sweep, and prefill 8 x 1k, this tree; AB_TREE's engine launches (--engine-only)
#              in the same call
#   throughput-1k-bf16 / -fp8kv / -fp8-fp8kv   offline 1000 x (1000 in, 1000 out), Llama-3.1-8B
#              shape: bf16 weights + bf16 cache (384 sequences), + fp8 cache (768), fp8 weights +
#              fp8 cache (768); -fp8kv-old / -fp8-fp8kv-old: AB_TREE's engine
#   latency-fp8kv-calibrated   batch 1 and 256 decode, bf16 weights, fp8 cache, rounded to nearest
#              and calibrated (`kv_cache_calibration`, the file from bench.calibrate_kv on the
#              random 8B checkpoint of bench/make_checkpoint.py): what the calibrated store costs
#   store-probe   bench/kv_store_probe.py: the fused rotary + store alone, nearest against
#              calibrated (1 and 256 tokens), this tree's kernel as it is, with 8 warps, rank 4 and
#              8 moves; AB_TREE's kernel as it is (e.g. .ab/c8: `git archive c8abfba engine`)
# Logs and JSON under $OUT; STEP_TIMEOUT (seconds, default 280) caps each step.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-decode-attention-ab}
mkdir -p "$OUT"
PY="timeout -k 5 ${STEP_TIMEOUT:-280} python3"
ROOT=$PWD
source bench/device_env.sh
OLD=${AB_TREE:+$(cd "$AB_TREE" && pwd)/engine}
THROUGHPUT_1K="-m kvfleet_cli.main bench throughput --shape llama-3.1-8b --num-prompts 1000
  --input-len 1000 --output-len 1000 --max-num-batched-tokens 16384"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
tree() {  # the engine tree a step runs: this one, or AB_TREE's
  export PYTHONPATH="/tmp/site:$1:$ROOT/operator"
}
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  tree "$ROOT/engine"
  case $step in
    tests) $PY -m pytest -m gpu tests/kernels/test_kv_fp8.py tests/kernels/test_triton_kernels.py \
        -k "decode or prefill or prefix or mixed or lazy or moment" -q -p no:cacheprovider -x 2>&1 \
        | tee "$OUT/tests-kernels.log" | tail -6
      $PY -m pytest -m gpu tests/engine/test_kv_cache_quantized.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/tests-engine.log" | tail -6 ;;
    kernels)
      $PY -m kvfleet_engine.bench.kernels --output-dir "$OUT/new" --cases decode prefill \
        --num-seqs 64 --context 4096 2>&1 | tee "$OUT/kernels-new.log" | grep -v Warning | tail -60
      $PY -m kvfleet_engine.bench.kernels --output-dir "$OUT/new" --cases decode --kv-cache-dtype fp8 \
        --num-seqs 512 --context 1536 2>&1 | tee -a "$OUT/kernels-new.log" | grep -v Warning | tail -40
      if [ -n "$OLD" ]; then
        tree "$OLD"
        for shape in "64 4096" "512 1536"; do
          set -- $shape
          $PY -m kvfleet_engine.bench.kernels --output-dir "$OUT/old" --cases decode prefill \
            --engine-only --num-seqs "$1" --context "$2" 2>&1 | tee -a "$OUT/kernels-old.log" | grep -v Warning | tail -25
        done
      fi ;;
    throughput-1k-bf16) $PY $THROUGHPUT_1K --max-num-seqs 384 --output-dir "$OUT/1k-bf16" 2>&1 \
        | tee "$OUT/1k-bf16.log" | grep -v 'it/s\]\|req/s\]' | tail -16 ;;
    throughput-1k-fp8kv|throughput-1k-fp8kv-old)
      [ "$step" = throughput-1k-fp8kv-old ] && tree "$OLD"
      $PY $THROUGHPUT_1K --max-num-seqs 768 --kv-cache-dtype fp8 --output-dir "$OUT/${step#throughput-}" \
        2>&1 | tee "$OUT/$step.log" | grep -v 'it/s\]\|req/s\]' | tail -16 ;;
    throughput-1k-fp8-fp8kv|throughput-1k-fp8-fp8kv-old)
      [ "$step" = throughput-1k-fp8-fp8kv-old ] && tree "$OLD"
      $PY $THROUGHPUT_1K --max-num-seqs 768 --kv-cache-dtype fp8 --quantization fp8 \
        --output-dir "$OUT/${step#throughput-}" 2>&1 | tee "$OUT/$step.log" \
        | grep -v 'it/s\]\|req/s\]' | tail -16 ;;
    latency-fp8kv-calibrated)
      CKPT=/dev/shm/kvfleet-8b-random
      [ -f "$CKPT/config.json" ] || timeout 150 python3 bench/make_checkpoint.py "$CKPT"
      $PY -m kvfleet_engine.bench.calibrate_kv "$CKPT" --device cuda \
        --output "$OUT/8b.kv-calibration.safetensors" 2>&1 | tail -2
      for bs in 1 256; do
        for cal in "" "--kv-cache-calibration $OUT/8b.kv-calibration.safetensors"; do
          $PY -m kvfleet_cli.main bench latency --shape llama-3.1-8b --kv-cache-dtype fp8 \
            --batch-size $bs $cal --output-dir "$OUT/latency-calibrated" 2>&1 \
            | tee -a "$OUT/$step.log" | grep -E "output_tokens_per_s|decode_step" | head -3
        done
      done ;;
    store-probe)
      for variant in "" "--warps 8" "--rank 4" "--steps 8"; do
        $PY bench/kv_store_probe.py $variant 2>&1 | tail -1 | tee -a "$OUT/$step.log"
      done
      if [ -n "$OLD" ]; then
        tree "$OLD"
        $PY bench/kv_store_probe.py 2>&1 | tail -1 | sed 's/^/AB_TREE /' | tee -a "$OUT/$step.log"
      fi ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
