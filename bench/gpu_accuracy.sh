#!/usr/bin/env bash
# `kvfleet bench accuracy` for SmolLM2 on the GPU. The quantized checkpoints are made on the dev
# machine (llmcompressor is not on the device machine) and travel in parts of at most 60 MiB:
#   here:    python -m kvfleet_engine.bench.quantize_smollm2 && bench/gpu_accuracy.sh pack
#            (tar of $KVFLEET_CACHE_DIR/models/smollm2-* split into .xfer/acc/all/part.*, with
#            SHA256SUMS; put part.* files one by one into .xfer/acc/p, keep SHA256SUMS beside)
#   device:  bench/gpu_accuracy.sh stage   (once per part, carry [".xfer/acc/p"]; kept on the
#            machine in /root/kvfleet-acc), then bench/gpu_accuracy.sh (carry [".xfer/acc/p"]
#            holding SHA256SUMS): checks and unpacks the parts, runs the benchmark, JSON to $OUT.
# ACCURACY_ARGS adds arguments (e.g. "--max-tokens 8192" for a quick run).
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-accuracy}
STAGE=/root/kvfleet-acc
MODELS=${KVFLEET_CACHE_DIR:-$HOME/.cache/kvfleet}/models
case "${1:-run}" in
  pack)
    mkdir -p .xfer/acc/all && rm -f .xfer/acc/all/part.*
    tar -C "$MODELS" -cf - $(cd "$MODELS" && ls -d smollm2-bf16 smollm2-gptq-w4a16 \
        smollm2-awq-w4a16 smollm2-fp8-dynamic smollm2-w8a16 2>/dev/null) \
      | split -b 60M -d - .xfer/acc/all/part.
    (cd .xfer/acc/all && sha256sum part.* > SHA256SUMS && cat SHA256SUMS)
    exit 0 ;;
  stage)
    mkdir -p "$STAGE" && cp .xfer/acc/p/part.* "$STAGE"/ && ls -la "$STAGE" && exit 0 ;;
esac
mkdir -p "$OUT" /tmp/kvc/models
export PYTHONPATH="$PWD/engine:$PWD/operator" PYTHONUNBUFFERED=1 KVFLEET_CACHE_DIR=/tmp/kvc
(cd "$STAGE" && sha256sum -c "$OLDPWD/.xfer/acc/p/SHA256SUMS") || exit 1
cat "$STAGE"/part.* | tar -C /tmp/kvc/models -xf - || exit 1
M=/tmp/kvc/models
CONFIGS=(--config "bf16=$M/smollm2-bf16" --config "fp8kv=$M/smollm2-bf16:kv_cache_dtype=fp8")
BOUNDS=(--bound fp8kv=0.5)
for pair in gptq:gptq-w4a16:8 awq:awq-w4a16:8 fp8:fp8-dynamic:1.5 int8:w8a16:1.5; do
  IFS=: read -r name scheme bound <<< "$pair"
  if [ -d "$M/smollm2-$scheme" ]; then
    CONFIGS+=(--config "$name=$M/smollm2-$scheme"); BOUNDS+=(--bound "$name=$bound")
  fi
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "=== bench accuracy ($(date +%T))"
timeout -k 5 "${STEP_TIMEOUT:-560}" python3 -m kvfleet_cli.main bench accuracy --device cuda \
  "${CONFIGS[@]}" "${BOUNDS[@]}" ${ACCURACY_ARGS:-} --output "$OUT" 2>&1 \
  | tee "$OUT/accuracy.log" | grep -v -i 'warn\|it/s\]' | tail -20
echo "=== done ($(date +%T))"
