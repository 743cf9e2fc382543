#!/usr/bin/env bash
# Device call: the embedded SmolLM2 on the GPU. The GGUF file (94 MiB) is larger than one call's
# 64 MiB transfer, so it travels in two parts: a first call runs `bench/gpu_smollm2.sh stage`
# with the first part carried in .xfer/a (it is kept on the machine), the next, with the second
# part in .xfer/b and the gguf wheel in .whl, runs this script without arguments: it rebuilds the
# file, checks its SHA-256, runs the engine's GPU tests, the SmolLM2 bf16 agreement test and
# `kvfleet bench chat` on the GPU. Logs and results JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-smollm2}
STAGE=/root/kvfleet-xfer
if [ "${1:-}" = stage ]; then
  mkdir -p "$STAGE" && cp .xfer/a/* "$STAGE"/ && ls -la "$STAGE" && exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD/engine:$PWD/operator" PYTHONUNBUFFERED=1
export KVFLEET_CACHE_DIR=/tmp/kvc
mkdir -p "$KVFLEET_CACHE_DIR/models"
cat "$STAGE"/part.* .xfer/b/part.* > "$KVFLEET_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf"
sha256sum "$KVFLEET_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
PY="timeout -k 5 ${STEP_TIMEOUT:-300} python3"
echo "=== engine GPU tests ($(date +%T))"
$PY -m pytest -m gpu tests/engine/test_gpu.py tests/engine/test_smollm2.py -q -s \
  -p no:cacheprovider 2>&1 | tee "$OUT/engine-tests.log" | grep -v Warning | tail -30
echo "=== bench chat on the GPU ($(date +%T))"
$PY -m kvfleet_cli.main bench chat --device cuda --concurrency 8 --output-len 128 \
  --output "$OUT" 2>&1 | grep -v -i 'warn\|convert\|loading' | tail -8
echo "=== done ($(date +%T))"
