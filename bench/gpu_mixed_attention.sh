#!/usr/bin/env bash
# One device call (~3 minutes, ~8 with the engine's GPU tests): prompt-step attention on the H200.
# The attention kernels' GPU tests (prefill, shared prefix, mixed steps) and, unless
# ENGINE_TESTS=0, tests/engine/test_gpu.py and tests/perf/test_cuda_graphs.py; then per tree
# (this one, and AB_TREE's engine/ when set: the same host and GPU) the prefill kernel alone
# (8 x 1k fresh prompts, bench.kernels --cases prefill) and steps that mix decode rows with a
# prompt chunk (python -m kvfleet_engine.bench.shared_prefix --mixed 512: 16-256 decode rows of
# 2,048 tokens, 1,536 of them shared, beside a 512-token chunk of the same length).
#   bash bench/gpu_mixed_attention.sh
#   AB_TREE=.ab/old bash bench/gpu_mixed_attention.sh   # git archive REV engine | tar -x -C .ab/old
# JSON under $OUT (<label>/attention-kernels*.json, <label>-mixed{,-fp8}.json).
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-mixed-attention}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
echo "=== GPU tests ($(date +%T))"
PYTHONPATH=$PWD/engine timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_triton_kernels.py tests/kernels/test_kv_fp8.py \
  -k "prefill or shared_prefix or mixed_step" 2>&1 | tail -3
if [ "${ENGINE_TESTS:-1}" = 1 ]; then  # one file a run: the two folders' conftests clash
  for tests in tests/engine/test_gpu.py tests/perf/test_cuda_graphs.py; do
    PYTHONPATH=$PWD/engine:$PWD/operator timeout 400 python3 -m pytest -q -p no:cacheprovider \
      -m gpu "$tests" -k "${ENGINE_K:-}" 2>&1 | grep -E "Error|passed|failed" | head -20
  done
fi
run_tree() {  # LABEL ENGINE_DIR
  echo "=== $1 ($2, $(date +%T))"
  PYTHONPATH=$2 python3 -m kvfleet_engine.bench.kernels --cases prefill --output-dir "$OUT/$1" \
    | grep -E "prefill_8x1k|best" | head -20
  for cache in "" --fp8; do
    PYTHONPATH=$2 python3 -m kvfleet_engine.bench.shared_prefix --seqs 16 64 256 --context 2048 \
      --prefix 1536 --mixed 512 $cache --output "$OUT/$1-mixed${cache:+-fp8}.json"
  done
}
run_tree new "$PWD/engine"
[ -n "${AB_TREE:-}" ] && run_tree old "$(cd "$AB_TREE" && pwd)/engine"
echo "=== done ($(date +%T))"
