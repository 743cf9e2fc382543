#!/usr/bin/env bash
# One device call (run tool, carry [".whl"]): batch-1 decode of the 8B shape (random weights,
# `kvfleet bench latency`) with the decode step's kernels launched in each PDL mode
# (`kernels/pdl.py`: KVFLEET_PDL=1 waits then lets the next kernel launch; early lets it launch
# first; prefetch also fetches each one-row product's first weight tiles into L2 before its
# wait), one process per mode and weights, modes alternating; then the modes' GPU tests (the
# one-row products' bits, the engine's greedy tokens) in what time is left. Prints one table;
# JSON and logs under $OUT.
#   bash bench/gpu_pdl_modes.sh                 # QUANTS (default fp8,awq), MODES (1 prefetch tail)
#   ROUNDS=2 bash bench/gpu_pdl_modes.sh        # the modes twice, alternating
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-pdl-modes}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
QUANTS=${QUANTS:-fp8,awq}
for round in $(seq "${ROUNDS:-1}"); do
  for mode in ${MODES:-1 prefetch tail}; do
    echo "=== round $round, KVFLEET_PDL=$mode ($(date +%T))"
    KVFLEET_PDL=$mode timeout -k 5 "${STEP_TIMEOUT:-170}" python3 -m kvfleet_cli.main bench latency \
      --shape llama-3.1-8b --quantization "$QUANTS" --max-num-seqs 4 --output-len 128 \
      --output-dir "$OUT/round$round-$mode" 2>&1 | tee "$OUT/round$round-$mode.log" \
      | grep -E 'tok/s|Error|error' | grep -v 'it/s\]' | tail -6
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
table = {}
for path in sorted(out.glob("round*-*/*-latency-*.json")):
    run = path.parent.name  # round<r>-<mode>
    for row in json.loads(path.read_text())["results"]:
        if row["metric"] == "decode_tokens_per_s" and row["system"].startswith("kvfleet"):
            table.setdefault(row["system"], {})[run] = row["value"]
runs = sorted({run for rows in table.values() for run in rows})
print(f"\n{'weights':<14}" + "".join(f"{run:>18}" for run in runs))
for system, rows in sorted(table.items()):
    print(f"{system:<14}" + "".join(f"{rows.get(run, float('nan')):>18.1f}" for run in runs))
(out / "pdl-modes.json").write_text(json.dumps({"decode_tokens_per_s": table}, indent=1))
PY
if [ "${TESTS:-1}" = 1 ]; then
  echo "=== tests ($(date +%T))"
  timeout -k 5 "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/kernels/test_pdl.py "tests/engine/test_quant_gpu.py::test_every_pdl_mode_gives_the_tokens_of_waiting_first" \
    2>&1 | tee "$OUT/tests.log" | grep -v Warning | tail -8
fi
echo "=== done ($(date +%T))"
