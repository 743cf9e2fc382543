#!/usr/bin/env bash
# One device call (run tool; carry [".whl"]): silu_and_mul_fp8 with each row held whole against
# read twice in chunks (bench/fp8_prompt_probe.py --silu-rows, NOTES section 29), then the decode
# steps of 512 x (1,000 in, 300 out), fp8 weights + fp8 cache, 512 sequences,
# profiled past their prompts (--host-trace 6 --host-trace-skip 80: the layer anatomy), then the
# kernel's gpu tests. Each step under its own cap; JSON and logs under $OUT.
#   bash bench/gpu_silu_rows.sh
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-silu-rows}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== probe ($(date +%T))"
(cd bench && timeout -k 5 120 python3 fp8_prompt_probe.py --silu-rows 17 64 128 256 512 768 \
  1024 2048 4096 16384 --output "$OUT/silu-rows.json") 2>&1 | grep -v Warning | tail -14
echo "=== decode anatomy ($(date +%T))"
timeout -k 5 "${STEP_TIMEOUT:-220}" python3 -m kvfleet_cli.main bench throughput \
  --shape llama-3.1-8b --num-prompts 512 --input-len 1000 --output-len 300 \
  --max-num-batched-tokens 16384 --max-num-seqs 512 --kv-cache-dtype fp8 --quantization fp8 \
  --host-trace 6 --host-trace-skip 80 --output-dir "$OUT/anatomy" 2>&1 \
  | grep -v "it/s\]\|req/s\]\|Warning\|_warn_once" | tee "$OUT/anatomy.log" \
  | grep -E "device ms per step|pattern|_kernel|nvjet|output_tokens_per_s|steps_busy" | head -30
echo "=== tests ($(date +%T))"
timeout -k 5 150 python3 -m pytest -m gpu tests/kernels/test_quant_matmul.py -k silu -q \
  -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -3
echo "=== done ($(date +%T))"
