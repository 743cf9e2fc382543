#!/usr/bin/env bash
# One device call (~6 minutes): decode attention over a shared prefix (kernels.shared_prefix) on
# the H200. The GPU tests of the kernels and of the engine with and without it; the kernel alone
# (python -m kvfleet_engine.bench.shared_prefix); then `kvfleet serve` on the random-weight
# Llama-3.1-8B-shaped checkpoint (bench/make_checkpoint.py) with the setting on, then off
# (--no-shared-prefix-attention), each driven by bench/serve_client.py through the issue-16
# shared-prefix load (c64, 256 x 2048->128, 1,536 shared) and the c64 512->256 load (no shared
# prefix: what the setting must not slow down). JSON lines and logs go to $OUT.
#   WHEELS=.whl/server bash bench/gpu_shared_prefix.sh   # WHEELS: as gpu_serve_core.sh
# SETTINGS (default: both) and LOADS (serve_client.py's CONCURRENCY NUM IN OUT [SHARED], ';'
# between loads) narrow or widen the served part; SERVE_ARGS adds `kvfleet serve` flags (e.g.
# --kv-cache-dtype fp8); KERNEL=0 skips the tests and the kernel alone. AB_TREE=DIR serves each
# setting from DIR's engine/ and operator/ too, after this tree's (the same host and GPU), e.g.
#   mkdir -p .ab/old && git archive ca51413 engine operator | tar -x -C .ab/old
set -uo pipefail
SETTINGS=${SETTINGS:-shared-prefix-attention no-shared-prefix-attention}
LOADS=${LOADS:-64 256 2048 128 1536;64 256 512 256}
OUT=${OUT:-/tmp/kvfleet-shared-prefix}
PORT=${PORT:-8100}
mkdir -p "$OUT"
source bench/serve_env.sh
if [ "${KERNEL:-1}" = 1 ]; then
echo "=== GPU tests ($(date +%T))"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_triton_kernels.py \
  tests/kernels/test_kv_fp8.py -k "shared_prefix or decode" 2>&1 | tail -3
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu.py \
  -k "shared_prefix or graphs_on_and_off" 2>&1 | tail -3
echo "=== the kernel alone ($(date +%T))"
python3 -m kvfleet_engine.bench.shared_prefix --seqs 16 64 256 --context 2048 --prefix 1536 \
  --output "$OUT/kernel.json"
python3 -m kvfleet_engine.bench.shared_prefix --seqs 16 64 256 --context 2048 --prefix 1536 \
  --fp8 --output "$OUT/kernel-fp8.json"
fi
SCRATCH=$(python3 -c "import shutil; print('/dev/shm' if shutil.disk_usage('/dev/shm').free > 20e9 else '/tmp')")
CKPT=$SCRATCH/kvfleet-8b-random
[ -f "$CKPT/config.json" ] || timeout 120 python3 bench/make_checkpoint.py "$CKPT" || exit 1
URL=http://127.0.0.1:$PORT
get() { python3 -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1]).read().decode())" "$1"; }
TREES="new=$PWD${AB_TREE:+ old=$(cd "$AB_TREE" && pwd)}"
BASE_PATH=$PYTHONPATH
for tree in $TREES; do
for setting in $SETTINGS; do
  label=${tree%%=*}
  dir=${tree#*=}
  export PYTHONPATH="${BASE_PATH//$PWD/$dir}"
  [ -n "${AB_TREE:-}" ] && label="$label-$setting" || label=$setting
  echo "=== serve --$setting from $dir ($(date +%T))"
  python3 -m kvfleet_cli.main serve --model "$CKPT" --served-model-name m --host 127.0.0.1 \
    --port "$PORT" --max-model-len 4096 --gpu-memory-utilization 0.9 "--$setting" ${SERVE_ARGS:-} \
    >"$OUT/serve-$label.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 240); do
    get "$URL/ready" >/dev/null 2>&1 && break
    kill -0 $SERVER 2>/dev/null || { tail -30 "$OUT/serve-$label.log"; exit 1; }
    sleep 1
  done
  grep -E "captured" "$OUT/serve-$label.log" | tail -2
  timeout 60 python3 bench/serve_client.py "$URL" m kvfleet 1 4 512 32 >/dev/null  # warm-up
  IFS=';' read -ra loads <<<"$LOADS"
  for load in "${loads[@]}"; do
    # shellcheck disable=SC2086
    timeout 150 python3 bench/serve_client.py "$URL" m "$label" $load \
      | tee -a "$OUT/serve_client.jsonl"
  done
  kill -TERM $SERVER
  wait $SERVER
done
done
export PYTHONPATH=$BASE_PATH
echo "=== table ($(date +%T))"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
rows = [json.loads(l) for l in (Path(sys.argv[1]) / "serve_client.jsonl").read_text().splitlines() if l]
print(f"{'setting':<30}{'load':<30}{'ok':>5}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}")
for r in rows:
    load = f"c{r['concurrency']} {r['num']}x{r['input_len']}->{r['output_len']}" + (
        f" ({r['shared_prefix']} shared)" if r["shared_prefix"] else "")
    print(f"{r['system']:<30}{load:<30}{r['ok']:>5}{r['out_tok_s']:>11}{r['ttft_p50_ms']:>10}"
          f"{r['ttft_p99_ms']:>10}{r['tpot_p50_ms']:>10}")
PY
echo "=== done ($(date +%T))"
