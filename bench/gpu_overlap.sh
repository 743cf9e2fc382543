#!/usr/bin/env bash
# One device call (run tool; carry [".whl"]): would a decode step gain from running its
# attention beside its products (NOTES section 29)? `python -m kvfleet_engine.bench.overlap_probe`
# on the 1k/1k workload's steps (fp8 weights, fp8 cache, 512 and 256 rows at 1.5k tokens of
# context), then on c256's (bf16, 256 rows at 640), each under its own cap. JSON and logs under
# $OUT. (The engine's decode graphs in two halves, measured beside it in session 34, did not
# land: NOTES section 29.) The fp8 probe also times the attention on part of the SMs (section 30).
#   bash bench/gpu_overlap.sh
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-overlap}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
probe() {  # name, then the probe's arguments
  local name=$1
  shift
  echo "=== probe $name ($(date +%T))"
  timeout -k 5 "${PROBE_TIMEOUT:-200}" python3 -m kvfleet_engine.bench.overlap_probe "$@" \
    --output "$OUT/overlap-$name.json" 2>&1 | grep -v Warning | tail -30
}
# PDL (the Triton kernels' programmatic dependent launch) as KVFLEET_PDL says: the probe's default
# is on; `KVFLEET_PDL=0 bash bench/gpu_overlap.sh` times the same with it off.
# The fp8 step also with its attention confined to green contexts of GREEN_SMS SMs (section 30).
# shellcheck disable=SC2086  # the SM counts are words
probe "fp8-pdl${KVFLEET_PDL:-1}" --rows 512 256 --context 1500 --weights fp8 --kv-cache-dtype fp8 \
  --green-sms ${GREEN_SMS:-32 64 96}
probe "bf16-pdl${KVFLEET_PDL:-1}" --rows 256 --context 640 --weights bf16 --kv-cache-dtype auto
echo "=== done ($(date +%T))"
