#!/usr/bin/env bash
# One device call (run tool): the quantization GPU tests, then batch-1 decode of the 8B shape
# (random weights) for bf16, fp8, int8, awq and gptq in one `kvfleet bench latency` process,
# printed as one table: tokens/s, ratio to bf16, fraction of each one's roofline (which counts
# its packed weight bytes). Logs and results JSON go to $OUT. Steps default to both:
#   bench/gpu_quant.sh tests latency
# STEP_TIMEOUT (seconds, default 420) caps each step; QUANTS the configurations (default
# none,fp8,int8,awq,gptq); LATENCY_ARGS adds arguments (e.g. "--kv-cache-dtype fp8").
# `prompt`: prompt throughput, 64 prompts of 3968 tokens and one output token each, for the
# weights in PROMPT_QUANTS (default none,fp8) in one `kvfleet bench throughput` process.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-quant}
mkdir -p "$OUT"
source bench/device_env.sh
PY="timeout -k 5 ${STEP_TIMEOUT:-420} ${PY:-python3}"
STEPS=${*:-tests latency}
SHAPE=${SHAPE:-llama-3.1-8b}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for step in $STEPS; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests) $PY -m pytest -m gpu tests/engine/test_quant_gpu.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/quant-tests.log" | grep -v Warning | tail -25 ;;
    latency) $PY -m kvfleet_cli.main bench latency --shape "$SHAPE" \
        --quantization "${QUANTS:-none,fp8,int8,awq,gptq}" --max-num-seqs 4 --output-len 128 \
        ${LATENCY_ARGS:-} --output-dir "$OUT" 2>&1 | tee "$OUT/latency.log" \
        | grep -v 'tok/s\]\|it/s\]' | tail -60
      python3 - "$OUT" <<'PY'
import json, pathlib, sys
[path] = sorted(pathlib.Path(sys.argv[1]).glob("*-latency-*.json"))[-1:]
rows = {(r["system"], r["metric"]): r["value"] for r in json.loads(path.read_text())["results"]}
def rate(system): return rows.get((system, "decode_tokens_per_s"))
base = rate("kvfleet")
print(f"\n{'weights':<8} {'tok/s':>8} {'vs bf16':>8} {'roofline':>9} {'of roof':>8} {'GB/step':>8}")
for q in ("none", "fp8", "int8", "awq", "gptq"):
    suffix = "" if q == "none" else f"-{q}"
    got, roof = rate(f"kvfleet{suffix}"), rate(f"roofline{suffix}")
    if got is None:
        continue
    gb = rows[(f"roofline{suffix}", "weight_bytes_per_step")]
    ratio = f"{got / base:.2f}x" if base else "-"
    print(f"{'bf16' if q == 'none' else q:<8} {got:>8.1f} {ratio:>8} {roof:>9.1f} {got / roof:>8.1%} {gb:>8.2f}")
PY
      ;;
    prompt) $PY -m kvfleet_cli.main bench throughput --shape "$SHAPE" --num-prompts 64 \
        --input-len 3968 --output-len 1 --max-num-seqs 64 --max-num-batched-tokens 16384 \
        --quantization "${PROMPT_QUANTS:-none,fp8}" --output-dir "$OUT/prompt" 2>&1 \
        | tee "$OUT/prompt.log" | grep -v 'it/s\]\|req/s\]' | tail -30 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
