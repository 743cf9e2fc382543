#!/usr/bin/env bash
# One device call (run tool; carry [".whl"]): does one persistent kernel streaming a layer's
# products beat a kernel per product at batch 1 (python -m kvfleet_engine.bench.persistent_chain,
# NOTES section 26)? First its GPU test (every tile's result against float32, 1 and 3 programs
# per SM), then the probe (32 layers of the 8B shape's fp8 products in a graph: the engine's
# kernels against the persistent launch at 2 and 3 programs per SM, waiting for the whole
# product before a tile or, --segments, only for the rows the tile reads (gate_up in 1 and 4
# K slices), and the tiles alone with no waits, which separates the waits' cost from the
# tiles'), then, unless ANATOMY=0, where a
# real decode step's time goes: `kvfleet bench latency --host-trace 20` for QUANTS (default
# fp8,awq; the layer anatomy at the end of its log). Each step under its own cap (a kernel that
# waits on a tile that never comes would hang). JSON and logs under $OUT.
#   bash bench/gpu_persistent_chain.sh
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-persistent-chain}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "=== test ($(date +%T))"
timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_persistent_chain.py \
  2>&1 | tee "$OUT/test.log" | grep -v Warning | tail -5
echo "=== probe ($(date +%T))"
timeout -k 5 240 python3 -m kvfleet_engine.bench.persistent_chain --programs-per-sm 2 3 \
  --segments 1 4 --no-wait --output "$OUT/persistent-chain.json" 2>&1 | tee "$OUT/probe.log" \
  | grep -v Warning | tail -12
if [ "${ANATOMY:-1}" != 0 ]; then
  echo "=== latency anatomy ($(date +%T))"
  timeout -k 5 "${STEP_TIMEOUT:-200}" python3 -m kvfleet_cli.main bench latency \
    --shape llama-3.1-8b --quantization "${QUANTS:-fp8,awq}" --max-num-seqs 4 --output-len 128 \
    --host-trace 20 --output-dir "$OUT/latency" 2>&1 | tee "$OUT/latency.log" \
    | grep -v 'tok/s\]\|it/s\]' | tail -70
fi
echo "=== done ($(date +%T))"
