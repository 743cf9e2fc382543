#!/usr/bin/env bash
# `kvfleet bench accuracy` for SmolLM2-135M-Instruct on the GPU, in device calls that carry at most
# ~60 MiB each. What travels is only what cannot be made there: the embedded GGUF (Q4_1), the
# `gguf` and `accelerate` wheels (transformers' GGUF reader needs both) and llm-compressor's GPTQ
# W4A16 checkpoint without its bf16 embedding (llmcompressor is not on the device machine; the
# embedding is not quantized, so it is taken back from the bf16 directory made there).
#   here:    python -m kvfleet_engine.bench.quantize_smollm2 --schemes gptq-w4a16
#            bench/gpu_accuracy.sh pack      (.xfer/acc/all/part.NN + SHA256SUMS)
#   device:  put one part at a time into .xfer/acc/p (carry [".xfer/acc/p"]) and run
#            `bench/gpu_accuracy.sh stage` (kept in /root/kvfleet-acc while the machine stays warm,
#            so the calls go back to back); the last call puts the last part and SHA256SUMS there
#            and runs `bench/gpu_accuracy.sh`: checks and unpacks the parts, makes the bf16
#            directory from the GGUF with transformers, puts the embedding back into the GPTQ
#            checkpoint, and compares, on the same text and prompts:
#              bf16    the GGUF dequantized to bf16 (the baseline)
#              fp8kv   bf16 weights, fp8 KV cache               (bound +0.5%)
#              fp8     bf16 quantized to fp8 W8A8 at load       (bound +1.5%)
#              int8    bf16 quantized to int8 W8A16 at load     (bound +1.5%)
#              gptq    llm-compressor GPTQ W4A16 group 64       (bound +8%)
#              q4_1    the GGUF itself, kept int4 group 32 on the GPU (what bf16 was made from)
# ACCURACY_ARGS adds arguments (e.g. "--max-tokens 8192" for a quick run); ACC_DEVICE (default
# cuda) is the bench's --device. JSON and log to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-accuracy}
STAGE=/root/kvfleet-acc
MODELS=${KVFLEET_CACHE_DIR:-$HOME/.cache/kvfleet}/models
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
stage() { mkdir -p "$STAGE" && cp .xfer/acc/p/part.* "$STAGE"/ 2>/dev/null; ls -la "$STAGE"; }
case "${1:-run}" in
  pack)
    # the gguf and accelerate wheels, and pyyaml and psutil (accelerate's) for Python 3.12
    WHEELS=${WHEELS:?WHEELS: a folder holding the wheels to install on the device}
    work=$(mktemp -d) && mkdir -p "$work/models/smollm2-gptq-w4a16" "$work/wheels" || exit 1
    cp "$WHEELS"/*.whl "$work/wheels/" && ln -s "$MODELS/$GGUF" "$work/models/$GGUF" || exit 1
    src="$MODELS/smollm2-gptq-w4a16"
    cp "$src"/*.json "$src"/*.jinja "$src"/*.yaml "$work/models/smollm2-gptq-w4a16/" || exit 1
    python - "$src/model.safetensors" "$work/models/smollm2-gptq-w4a16/no-embed.safetensors" <<'PY'
import sys
from safetensors import safe_open
from safetensors.torch import save_file
with safe_open(sys.argv[1], "pt") as f:
    save_file({k: f.get_tensor(k) for k in f.keys() if k != "model.embed_tokens.weight"},
              sys.argv[2], metadata={"format": "pt"})
PY
    mkdir -p .xfer/acc/all && rm -f .xfer/acc/all/part.*
    tar -C "$work" -chf - models wheels | split -b 52M -d - .xfer/acc/all/part.
    (cd .xfer/acc/all && sha256sum part.* > SHA256SUMS && cat SHA256SUMS)
    rm -rf "$work"; exit 0 ;;
  stage) stage; exit 0 ;;
esac
stage
mkdir -p "$OUT" /tmp/kvc
export PYTHONPATH="/tmp/site:$PWD/engine:$PWD/operator" PYTHONUNBUFFERED=1 KVFLEET_CACHE_DIR=/tmp/kvc
(cd "$STAGE" && sha256sum -c "$OLDPWD/.xfer/acc/p/SHA256SUMS") || exit 1
cat "$STAGE"/part.* | tar -C /tmp/kvc -xf - || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/kvc/wheels/*.whl \
  || exit 1
M=/tmp/kvc/models
echo "=== bf16 from the GGUF, embedding into the GPTQ checkpoint ($(date +%T))"
python3 - "$M" "$GGUF" <<'PY' || exit 1
import sys
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import save_file
from kvfleet_engine.bench.quantize_smollm2 import write_bf16
models = Path(sys.argv[1])
write_bf16(models / sys.argv[2], models / "smollm2-bf16")
with safe_open(models / "smollm2-bf16/model.safetensors", "pt") as f:
    tensors = {"model.embed_tokens.weight": f.get_tensor("model.embed_tokens.weight")}
gptq = models / "smollm2-gptq-w4a16"
with safe_open(gptq / "no-embed.safetensors", "pt") as f:
    tensors.update({k: f.get_tensor(k) for k in f.keys()})
save_file(tensors, gptq / "model.safetensors", metadata={"format": "pt"})
(gptq / "no-embed.safetensors").unlink()
print("ok")
PY
B="$M/smollm2-bf16"
CONFIGS=(--config "bf16=$B" --config "fp8kv=$B:kv_cache_dtype=fp8"
  --config "fp8=$B:quantization=fp8" --config "int8=$B:quantization=int8"
  --config "gptq=$M/smollm2-gptq-w4a16" --config "q4_1=$M/$GGUF")
BOUNDS=(--bound fp8kv=0.5 --bound fp8=1.5 --bound int8=1.5 --bound gptq=8)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "=== bench accuracy ($(date +%T))"
timeout -k 5 "${STEP_TIMEOUT:-480}" python3 -m kvfleet_cli.main bench accuracy \
  --device "${ACC_DEVICE:-cuda}" "${CONFIGS[@]}" "${BOUNDS[@]}" ${ACCURACY_ARGS:-} --output "$OUT" 2>&1 \
  | tee "$OUT/accuracy.log" | grep -v -i 'warn\|it/s\]' | tail -30
echo "=== done ($(date +%T))"
