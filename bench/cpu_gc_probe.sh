#!/usr/bin/env bash
# The API process's garbage collector under 1,024 streams, on the CPU with the tiny model:
# `kvfleet serve` with the young-generation threshold at CPython's 700 and at the engine's
# (core.heap.GEN0_THRESHOLD), ROUNDS times each, alternating; `kvfleet bench serve` drives
# 3,072 requests (32 -> 64 tokens) and GET /debug/profile says how many collections of each
# generation ran and how long they paused the API process's loop (every stream waits meanwhile).
#   bash bench/cpu_gc_probe.sh [OUT.json]     # ROUNDS (default 2), PORT (8123)
# Throughput on a 2-core machine varies by 20% from run to run (both processes share the cores);
# the collections and their pauses are what this measures.
set -uo pipefail
OUT=${1:-bench/results/$(date -u +%F)-cpu-gc-thresholds-c1024.json}
PORT=${PORT:-8123}
PY=${PY:-.venv/bin/python}
WORK=$(mktemp -d)
[ -f "$WORK/tiny/config.json" ] || $PY -m kvfleet_cli.main tiny-model "$WORK/tiny" >/dev/null
ENGINE=$($PY -c "from kvfleet_engine.core.heap import GEN0_THRESHOLD as t; print(t)")
URL=http://127.0.0.1:$PORT
for round in $(seq "${ROUNDS:-2}"); do
  for gen0 in 700 "$ENGINE"; do
    $PY bench/gc_serve.py "$gen0" --model "$WORK/tiny" --device cpu --port "$PORT" \
      --max-num-seqs 1024 --max-model-len 256 --served-model-name tiny >"$WORK/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 120); do curl -sf "$URL/ready" >/dev/null && break; sleep 1; done
    $PY -m kvfleet_engine.bench.profile_split --url "$URL" --label "gen0 $gen0" \
      --output "$WORK/split-$gen0-$round.json" -- $PY -m kvfleet_cli.main bench serve \
      --url "$URL" --model tiny --no-progress --concurrency 1024 --num-prompts 3072 \
      --random-input-len 32 --random-output-len 64 --output "$WORK/bench-$gen0-$round.json" \
      | grep -E "^api|output token throughput|tpot_ms"
    kill -TERM $server; wait $server
  done
done
$PY - "$WORK" "$OUT" "$ENGINE" <<'PY'
import json, pathlib, sys
work, out, engine = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
runs = []
for split in sorted(work.glob("split-*.json")):
    _, gen0, rnd = split.stem.split("-")
    api = json.loads(split.read_text())["api"]
    res = json.loads((work / f"bench-{gen0}-{rnd}.json").read_text())["results"]
    runs.append({
        "gen0_threshold": int(gen0), "round": int(rnd),
        "api_gc_collections": api["gc_collections"], "api_gc_pause_s": api["gc_pause_s"],
        "output_tok_s": round(res["output_token_throughput"]),
        "tpot_ms": {k: round(res["tpot_ms"][k], 1) for k in ("p50", "p99")},
        "completed": res["completed"], "failed": res["failed"],
    })
json.dump({"machine": "cpu (2 cores)", "command": "bash bench/cpu_gc_probe.sh",
           "engine_gen0_threshold": int(engine), "runs": runs}, open(out, "w"), indent=1)
for r in runs:
    print(f"gen0 {r['gen0_threshold']:>6}: collections {r['api_gc_collections']}, pauses "
          f"{[round(p, 2) for p in r['api_gc_pause_s']]} s, {r['output_tok_s']} tok/s, "
          f"TPOT p50/p99 {r['tpot_ms']['p50']}/{r['tpot_ms']['p99']} ms")
print("wrote", out)
PY
rm -rf "$WORK"
