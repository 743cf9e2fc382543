#!/usr/bin/env bash
# One device call (under 9 minutes): the engine core in its own process, served on the H200.
# Builds the random-weight Llama-3.1-8B-shaped checkpoint (bench/make_checkpoint.py, ~25 s),
# starts `kvfleet serve` on it, runs the issue-16 loads with bench/serve_client.py (8 client
# processes, the method of the vLLM comparison) and with `kvfleet bench serve --client-processes
# 8`, drains it with SIGTERM, then measures the offline figures for the same requests
# (bench/offline_serve_requests.py). JSON lines and logs go to $OUT (four files: serve_client.jsonl,
# offline.json, metrics.txt and serve-core-rest.tgz with the rest); a table at the end.
# Around the c1, c256 and c1024 serve_client.py loads it reads GET /debug/profile
# (python -m kvfleet_engine.bench.profile_split): per process, how busy its loop thread was
# (near 1.0: that process limits the server) and on what (named phases, GC pauses), and c1's
# first-token hops; printed after the table, JSON in $OUT/profile-*.json.
# Every load also records what the server counted while it ran (python -m
# kvfleet_engine.bench.serve_counters): the share of its prompt tokens the prefix cache held —
# serve_client.py's prompts come from one seed, so c256's first 256 are c64's and c1024's first
# 512 are c256's — and the engine's steps by kind. `kvfleet bench serve` runs c256 and c1024
# again with prompts no earlier load sent (c256-cold, c1024-cold); BENCH_LOADS picks its loads
# (default: all seven), CLIENT_LOADS serve_client.py's (default: c1 c64 c256 c1024 shared),
# BENCH_SERVE=0 skips bench serve, OFFLINE=0 the offline figures, SERVE_ARGS adds `kvfleet serve`
# flags (e.g. "--max-num-batched-tokens 16384"): e.g. the c256 hops alone,
#   CLIENT_LOADS="c1 c256" BENCH_SERVE=0 OFFLINE=0 WHEELS=.whl/server bash bench/gpu_serve_core.sh
#   WHEELS=.whl/server bash bench/gpu_serve_core.sh   # WHEELS: fastapi, starlette, uvicorn,
#     # pydantic(-core), annotated-types/-doc, typing-inspection, msgspec, httptools and, for
#     # fastapi 0.165, opentelemetry-api wheels (the device image lacks them; cp312 manylinux);
#     # the GGUF GPU tests (bench/gpu_check.sh engine-tests) also need gguf's (py3-none-any)
# Loads (512-token prompts): c1 8 x 512->128, c64 256 x 512->256, c256 512 x 512->256,
# c1024 2048 x 512->256, shared prefix c64 256 x 2048->128 (1536 shared).
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-serve-core}
PORT=${PORT:-8100}
mkdir -p "$OUT"
# The run tool brings back at most 8 files: the client lines, the offline figure and the
# counters stay as they are, everything else (bench serve JSON, profiles, server log) goes into
# one archive, however the script ends (a step's cap, the call's limit, an early exit).
bundle() {
  local rest
  rest=$(cd "$OUT" && ls | grep -vxE 'serve_client.jsonl|offline.json|metrics.txt|serve-core-rest.tgz')
  [ -n "$rest" ] && (cd "$OUT" && tar czf serve-core-rest.tgz --remove-files $rest)
  echo "under \$OUT: $(ls "$OUT" | tr '\n' ' ')"
}
trap bundle EXIT
trap 'exit 143' TERM INT  # a step's or the call's timeout: bundle on the way out
source bench/serve_env.sh
# uvicorn's "auto" picks httptools and uvloop when they import (h11 and asyncio's loop if not).
python3 -c "
import importlib.util as u
print('uvicorn http:', 'httptools' if u.find_spec('httptools') else 'h11 (no httptools wheel)',
      '| loop:', 'uvloop' if u.find_spec('uvloop') else 'asyncio (no uvloop wheel)')"
SCRATCH=$(python3 -c "import shutil; print('/dev/shm' if shutil.disk_usage('/dev/shm').free > 20e9 else '/tmp')")
CKPT=$SCRATCH/kvfleet-8b-random
echo "=== checkpoint ($(date +%T))"
[ -f "$CKPT/config.json" ] || timeout 120 python3 bench/make_checkpoint.py "$CKPT" || exit 1
echo "=== serve ($(date +%T))"
# shellcheck disable=SC2086  # SERVE_ARGS: flags, split into words
python3 -m kvfleet_cli.main serve --model "$CKPT" --served-model-name m --host 127.0.0.1 \
  --port "$PORT" --max-model-len 4096 --gpu-memory-utilization 0.9 ${SERVE_ARGS:-} \
  >"$OUT/serve.log" 2>&1 &
SERVER=$!
t0=$(date +%s)
get() { python3 -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1]).read().decode())" "$1"; }
for _ in $(seq 240); do
  get "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { tail -30 "$OUT/serve.log"; exit 1; }
  sleep 1
done
echo "ready after $(( $(date +%s) - t0 )) s"
grep -E "engine core|self-benchmark|ready" "$OUT/serve.log" | tail -4
URL=http://127.0.0.1:$PORT
counted() {  # the command, then one JSON line of the server's counters during it
  python3 -m kvfleet_engine.bench.serve_counters --url "$URL" -- "$@"
}
client() {  # CONCURRENCY NUM IN OUT [SHARED]
  counted timeout 150 python3 bench/serve_client.py "$URL" m kvfleet "$@" \
    | tee -a "$OUT/serve_client.jsonl"
}
profiled() {  # NAME, then client's arguments: the load with the server's profile around it
  local name=$1; shift
  python3 -m kvfleet_engine.bench.profile_split --url "$URL" --label "$name" \
    --output "$OUT/profile-$name.json" -- \
    python3 -m kvfleet_engine.bench.serve_counters --url "$URL" -- \
    timeout 150 python3 bench/serve_client.py "$URL" m kvfleet "$@" >"$OUT/profile-$name.txt"
  grep '^{' "$OUT/profile-$name.txt" | tee -a "$OUT/serve_client.jsonl"
}
bench() {  # NAME, then bench serve flags (its JSON holds the server's counters itself)
  local name=$1; shift
  case " ${BENCH_LOADS:-c1 c64 c256 c1024 shared c256-cold c1024-cold} " in
    *" $name "*) ;;
    *) return 0 ;;
  esac
  timeout 150 python3 -m kvfleet_cli.main bench serve --url "$URL" --model m --no-progress \
    --client-processes 8 --random-token-range 1000:119999 --output "$OUT/bench-$name.json" "$@" \
    | grep -E "completed|output token throughput|ttft_ms|tpot_ms|server:" | sed "s/^/  [$name] /"
}
want() {  # CLIENT_LOADS picks serve_client.py's loads (default: all five)
  case " ${CLIENT_LOADS:-c1 c64 c256 c1024 shared} " in *" $1 "*) return 0 ;; esac
  return 1
}
echo "=== serve_client.py loads ($(date +%T))"
client 1 4 512 32 >/dev/null  # warm-up
want c1 && profiled c1 1 8 512 128
want c64 && client 64 256 512 256
want c256 && profiled c256 256 512 512 256
want c1024 && profiled c1024 1024 2048 512 256
want shared && client 64 256 2048 128 1536
if [ "${BENCH_SERVE:-1}" = 1 ]; then  # BENCH_SERVE=0 skips the same loads from kvfleet bench serve
echo "=== kvfleet bench serve loads ($(date +%T))"
bench c1 --concurrency 1 --num-prompts 8 --random-input-len 512 --random-output-len 128
bench c64 --concurrency 64 --num-prompts 256 --random-input-len 512 --random-output-len 256
bench c256 --concurrency 256 --num-prompts 512 --random-input-len 512 --random-output-len 256
bench c1024 --concurrency 1024 --num-prompts 2048 --random-input-len 512 --random-output-len 256
bench shared --concurrency 64 --num-prompts 256 --random-input-len 2048 \
  --random-prefix-len 1536 --random-output-len 128
# Prompts no earlier load sent (another seed): nothing from the prefix cache.
bench c256-cold --concurrency 256 --num-prompts 512 --random-input-len 512 \
  --random-output-len 256 --seed 256
bench c1024-cold --concurrency 1024 --num-prompts 2048 --random-input-len 512 \
  --random-output-len 256 --seed 1024
fi
get "$URL/metrics" | grep -E "^kvfleet_(engine|generation|prompt|request_success|preemptions)" \
  >"$OUT/metrics.txt"
echo "=== drain ($(date +%T))"
kill -TERM $SERVER
wait $SERVER
echo "server exit code $?"
if [ "${OFFLINE:-1}" = 1 ]; then  # OFFLINE=0 skips the offline figures
echo "=== offline, same requests ($(date +%T))"
timeout 200 python3 bench/offline_serve_requests.py "$CKPT" "$OUT/offline.json" 2>&1 \
  | grep '^{' | tail -1
fi
echo "=== table ($(date +%T))"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
lines = [json.loads(line) for line in (out / "serve_client.jsonl").read_text().splitlines() if line]
rows = []  # each client line, with the server's counters (the line after it) attached
for line in lines:
    if "label" in line:
        if rows:
            rows[-1]["server"] = line["server"]
    else:
        rows.append(line)
offline = json.loads((out / "offline.json").read_text()) if (out / "offline.json").exists() else {}

def server_cells(server):
    if not server:
        return f"{'-':>7}{'-':>22}"
    steps = "/".join(str(server.get(f"steps_{k}", 0)) for k in ("prefill", "mixed", "decode"))
    return f"{server['prefix_cache_hit_ratio']:>7.0%}{steps:>22}"

print(f"{'load':<26}{'ok/failed':>10}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
      f"{'cached':>7}{'steps pre/mix/dec':>22}")
for r in rows:
    name = f"c{r['concurrency']} {r['num']}x{r['input_len']}->{r['output_len']}" + (f" ({r['shared_prefix']} shared)" if r["shared_prefix"] else "")
    print(f"{name:<26}{str(r['ok']) + '/' + str(r['failed']):>10}{r['out_tok_s']:>11}{r['ttft_p50_ms']:>10}{r['ttft_p99_ms']:>10}{r['tpot_p50_ms']:>10}"
          + server_cells(r.get("server")))
print("offline, same requests:", json.dumps(offline))
for path in sorted(out.glob("bench-*.json")):
    res = json.loads(path.read_text())["results"]
    name = f"bench serve {path.stem[6:]}"
    print(f"{name:<26}{str(res['completed']) + '/' + str(res['failed']):>10}"
          f"{res['output_token_throughput']:>11.0f}{res['ttft_ms']['p50']:>10.1f}"
          f"{res['ttft_ms']['p99']:>10.1f}{res['tpot_ms']['p50']:>10.2f}" + server_cells(res.get("server")))
PY
echo "=== where the time went: GET /debug/profile around the load"
for name in c1 c256 c1024; do grep -v '^{' "$OUT/profile-$name.txt" 2>/dev/null; done
echo "=== done ($(date +%T))"
