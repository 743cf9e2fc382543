#!/usr/bin/env bash
# Issue 16's latency check in one short device call: the served c1 8x512->128 (with the server's
# /debug/profile around it) and c64 256x512->256 loads, then offline bs1 (bench/serve_offline_bs1.py:
# TTFT, TPOT, step phases, and how fast this host is: a pure-Python loop, one CUDA launch).
# With AB_TREE=DIR it runs the same for a second tree in the same session (same host, same GPU),
# e.g. the run2 commit:  git archive 4ef429d engine operator | (mkdir -p old16 && tar -x -C old16)
#   WHEELS=.whl/server bash bench/gpu_serve_c1.sh                 # ~1.5 min
#   WHEELS=.whl/server AB_TREE=old16 bash bench/gpu_serve_c1.sh   # ~3 min: this tree, then old16
# JSON under $OUT (serve_client.jsonl, profile-*.json, offline-*.json, host.json); a table last.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-serve-c1}
PORT=${PORT:-8100}
mkdir -p "$OUT"
ulimit -n 65536 2>/dev/null || ulimit -n 8192
export PYTHONUNBUFFERED=1
SITE=""
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  SITE=/tmp/site
fi
python3 - "$OUT/host.json" <<'PY'
import json, os, platform, subprocess, sys
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,pstate",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
host = {"cpu": cpu, "cpus": os.cpu_count(), "gpu": smi, "python": platform.python_version(),
        "CUBLAS_WORKSPACE_CONFIG (before import)": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
print("host:", json.dumps(host)); json.dump(host, open(sys.argv[1], "w"), indent=1)
PY
SCRATCH=$(python3 -c "import shutil; print('/dev/shm' if shutil.disk_usage('/dev/shm').free > 20e9 else '/tmp')")
CKPT=$SCRATCH/kvfleet-8b-random
[ -f "$CKPT/config.json" ] || timeout 120 python3 bench/make_checkpoint.py "$CKPT" || exit 1
URL=http://127.0.0.1:$PORT
get() { python3 -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1]).read().decode())" "$1"; }

run_tree() {  # LABEL TREE
  local label=$1 tree
  tree=$(cd "$2" && pwd)
  export PYTHONPATH="${SITE:+$SITE:}$tree/engine:$tree/operator"
  echo "=== $label: serve ($tree, $(date +%T))"
  python3 -m kvfleet_cli.main serve --model "$CKPT" --served-model-name m --host 127.0.0.1 \
    --port "$PORT" --max-model-len 4096 --gpu-memory-utilization 0.9 >"$OUT/serve-$label.log" 2>&1 &
  local server=$! t0
  t0=$(date +%s)
  for _ in $(seq 150); do
    get "$URL/ready" >/dev/null 2>&1 && break
    kill -0 $server 2>/dev/null || { tail -20 "$OUT/serve-$label.log"; return 1; }
    sleep 1
  done
  echo "ready after $(( $(date +%s) - t0 )) s"
  local core
  core=$(pgrep -P $server -f spawn_main | head -1)
  [ -n "$core" ] && tr '\0' '\n' <"/proc/$core/environ" | grep -E '^CUBLAS' | sed "s/^/  core env: /"
  timeout 60 python3 bench/serve_client.py "$URL" m "$label" 1 4 512 32 >/dev/null  # warm-up
  python3 -m kvfleet_engine.bench.profile_split --url "$URL" --label "$label c1" \
    --output "$OUT/profile-$label-c1.json" -- \
    timeout 60 python3 bench/serve_client.py "$URL" m "$label" 1 8 512 128 >"$OUT/profile-$label-c1.txt"
  grep '^{' "$OUT/profile-$label-c1.txt" >>"$OUT/serve_client.jsonl"
  timeout 60 python3 bench/serve_client.py "$URL" m "$label" 64 256 512 256 >>"$OUT/serve_client.jsonl"
  kill -TERM $server
  wait $server
  echo "=== $label: offline bs1 ($(date +%T))"
  timeout 100 python3 bench/serve_offline_bs1.py "$CKPT" "$OUT/offline-$label.json" | tail -1
}

run_tree new .
[ -n "${AB_TREE:-}" ] && run_tree old "$AB_TREE"
echo "=== table ($(date +%T))"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [json.loads(l) for l in (out / "serve_client.jsonl").read_text().splitlines() if l.startswith("{")]
print(f"{'tree':<5}{'load':<18}{'ok/failed':>10}{'tok/s':>7}{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}"
      f"{'core launch ms/step':>20}{'token hop ms':>13}")
for r in rows:
    label = r["system"]
    extra = ""
    prof = out / f"profile-{label}-c1.json"
    if r["concurrency"] == 1 and prof.exists():
        p = json.loads(prof.read_text())
        launch = p["core"]["phases"]["launch"]
        extra = f"{launch['s'] / max(launch['count'], 1) * 1e3:>20.3f}{p['api']['first_token_ms'].get('token', 0):>13.2f}"
    load = f"c{r['concurrency']} {r['num']}x{r['input_len']}->{r['output_len']}"
    print(f"{label:<5}{load:<18}{str(r['ok']) + '/' + str(r['failed']):>10}{r['out_tok_s']:>7}"
          f"{r['ttft_p50_ms']:>9}{r['ttft_p99_ms']:>7}{r['tpot_p50_ms']:>9}{extra}")
    if r["failed"]:
        print("   errors:", r["errors"])
for path in sorted(out.glob("offline-*.json")):
    o = json.loads(path.read_text())
    print(f"{path.stem[8:]:<5}offline bs1 TTFT {o['bs1_ttft_ms']} ms (launch {o['bs1_ttft_phases_ms'].get('launch')}),"
          f" TPOT {o['bs1_tpot_ms']} ms (launch {o['bs1_128_phases_ms'].get('launch')} ms/step);"
          f" host: python loop {o['host_python_ms']} ms, CUDA launch {o['host_launch_us']} us")
PY
echo "run2 (4ef429d, 13:23): c1 TTFT p50 22.0, token hop 19.56, core launch 0.48 ms/step, c64 TPOT 6.7; offline bs1 TTFT 18.3, TPOT 4.43"
echo "=== done ($(date +%T))"
