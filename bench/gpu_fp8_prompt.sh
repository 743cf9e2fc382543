#!/usr/bin/env bash
# Device calls (run tool) for the fp8 prompt path of 2026-12-05 (per-token e4m3 rows made by the
# kernels that produce them: the norms before qkv / gate_up and silu * up before down; one-pass
# row quantization), against another tree in the same call:
#   bash bench/gpu_fp8_prompt.sh tests probe                          # call 1
#   AB_TREE=.ab/head bash bench/gpu_fp8_prompt.sh prompt prompt-old    # call 2
# (.ab/head: `git archive 19022bb engine | tar -x -C .ab/head`, git-ignored, carried with
# .whl/server, the wheels the device lacks.)
# Steps:
#   tests       gpu-marked tests: the fp8 products and row kernels (tests/kernels/test_quant_matmul.py)
#               and the fp8 engine tests (tests/engine/test_quant_gpu.py)
#   probe       bench/fp8_prompt_probe.py: one 8B layer's products, norms, activation and row
#               quantization at 16,384 rows, bf16 against fp8
#   prompt      64 x 3,968-token prompts, one output token, Llama-3.1-8B shape, bf16 and fp8
#               weights in one `kvfleet bench throughput` process (this tree)
#   prompt-old  the same, fp8 weights, AB_TREE's engine
# Logs and JSON under $OUT; STEP_TIMEOUT (seconds, default 280) caps each step.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-fp8-prompt}
mkdir -p "$OUT"
PY="timeout -k 5 ${STEP_TIMEOUT:-280} python3"
ROOT=$PWD
source bench/device_env.sh
OLD=${AB_TREE:+$(cd "$AB_TREE" && pwd)/engine}
PROMPT="-m kvfleet_cli.main bench throughput --shape llama-3.1-8b --num-prompts 64
  --input-len 3968 --output-len 1 --max-num-seqs 64 --max-num-batched-tokens 16384"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
tree() {  # the engine tree a step runs: this one, or AB_TREE's
  export PYTHONPATH="/tmp/site:$1:$ROOT/operator"
}
rate() {  # the prompt tokens per second of each system in a results directory
  python3 - "$1" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for row in json.loads(path.read_text())["results"]:
        if row["metric"] == "total_tokens_per_s":
            print(f"{path.parent.name:<12} {row['system']:<14} {row['value']:>10.1f} prompt tok/s")
PY
}
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  tree "$ROOT/engine"
  case $step in
    tests)
      $PY -m pytest -m gpu tests/kernels/test_quant_matmul.py -k "fp8 or norm or silu" -q \
        -p no:cacheprovider 2>&1 | tee "$OUT/tests-kernels.log" | tail -4
      $PY -m pytest -m gpu tests/engine/test_quant_gpu.py -k "fp8" -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/tests-engine.log" | tail -4 ;;
    probe) $PY bench/fp8_prompt_probe.py --output "$OUT/probe.json" 2>&1 \
        | tee "$OUT/probe.log" | grep -v '^{' ;;
    prompt) $PY $PROMPT --quantization none,fp8 --output-dir "$OUT/new" 2>&1 \
        | tee "$OUT/prompt.log" | grep -v 'it/s\]\|req/s\]' | tail -8
      rate "$OUT/new" ;;
    prompt-old)
      tree "$OLD"
      $PY $PROMPT --quantization fp8 --output-dir "$OUT/old" 2>&1 | tee "$OUT/prompt-old.log" \
        | grep -v 'it/s\]\|req/s\]' | tail -8
      rate "$OUT/old" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
