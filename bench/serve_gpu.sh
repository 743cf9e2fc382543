#!/usr/bin/env bash
# One device call: `kvfleet serve` a random-weight model of a named shape on the GPU, then load
# it with `kvfleet bench serve` (latency at concurrency 1, throughput at concurrency 64).
# Results JSON and the server log go to $OUT.
#   WHEELS=.whl/server bash bench/serve_gpu.sh        # WHEELS: fastapi/uvicorn/pydantic wheels
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-serve-gpu}
SHAPE=${SHAPE:-llama-3.1-8b}
PORT=${PORT:-8000}
mkdir -p "$OUT"
source bench/serve_env.sh
# RAM-backed scratch when it has room for the checkpoint (16 GB for the 8B shape).
SCRATCH=$(python3 -c "import shutil; print('/dev/shm' if shutil.disk_usage('/dev/shm').free > 20e9 else '/tmp')")
CKPT=$SCRATCH/kvfleet-$SHAPE
echo "=== checkpoint $SHAPE ($(date +%T))"
python3 - "$SHAPE" "$CKPT" <<'EOF' || exit 1
import sys
from pathlib import Path

import torch

from kvfleet_engine.bench import shapes

model = shapes.build_random_model(sys.argv[1], torch.bfloat16, "cuda")
shapes.save_checkpoint(model, Path(sys.argv[2]))
EOF
echo "=== serve ($(date +%T))"
python3 -m kvfleet_cli.main serve --model "$CKPT" --served-model-name "$SHAPE-random" \
  --host 127.0.0.1 --port "$PORT" --max-model-len 4096 >"$OUT/serve.log" 2>&1 &
SERVER=$!
get() { python3 -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1]).read().decode())" "$1"; }
for _ in $(seq 300); do
  get "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { tail -30 "$OUT/serve.log"; exit 1; }
  sleep 1
done
grep -E "self-benchmark|ready" "$OUT/serve.log"
bench() {  # name, then bench serve flags
  local name=$1; shift
  echo "=== bench $name ($(date +%T))"
  python3 -m kvfleet_cli.main bench serve --url "http://127.0.0.1:$PORT" --no-progress \
    --output "$OUT/serve-$SHAPE-$name.json" "$@"
}
bench c1 --concurrency 1 --num-prompts 8 --random-input-len 512 --random-output-len 128
bench c64 --concurrency 64 --num-prompts 256 --random-input-len 512 --random-output-len 256 \
  --goodput ttft:1000 tpot:50
get "http://127.0.0.1:$PORT/metrics" | grep -E "^kvfleet_(engine|generation|prompt|request_success)" \
  >"$OUT/metrics.txt"
echo "=== drain ($(date +%T))"
kill -TERM $SERVER
wait $SERVER
echo "server exit code $?"
cat "$OUT/metrics.txt"
