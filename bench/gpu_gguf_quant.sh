#!/usr/bin/env bash
# One device call (run tool, carry .whl with the `gguf` wheel, as bench/gpu_smollm2.sh does): the
# GPU tests of GGUF blocks kept quantized (tests/engine/test_gguf_quantized.py -m gpu): tiny
# 256-wide llama3 GGUF files in Q8_0 / Q4_0 / Q4_1 / Q4_K served on CUDA with quantization auto;
# every layer's int8 / int4 group-32 kernel against layout.py's reference at 1, 7 and 64 rows;
# greedy tokens with and without CUDA graphs. About 2 minutes. Log and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-gguf-quant}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD/engine:$PWD/operator"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "=== GGUF quantized GPU tests ($(date +%T))"
timeout -k 5 ${STEP_TIMEOUT:-420} python3 -m pytest -m gpu tests/engine/test_gguf_quantized.py \
  -q -p no:cacheprovider --junitxml "$OUT/gguf-quant-tests.xml" 2>&1 \
  | tee "$OUT/gguf-quant-tests.log" | grep -v Warning | tail -25
python3 - "$OUT" <<'PY'
import json, pathlib, sys, xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
cases = ET.parse(out / "gguf-quant-tests.xml").iter("testcase")
rows = {c.get("name"): next((x.tag for x in c if x.tag in ("failure", "error", "skipped")), "passed")
        for c in cases}
for name, outcome in rows.items():
    print(f"{outcome:8} {name}")
(out / "gguf-quant-tests.json").write_text(json.dumps(rows, indent=1))
PY
echo "=== done ($(date +%T))"
