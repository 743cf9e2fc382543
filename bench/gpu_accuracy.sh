#!/usr/bin/env bash
# `kvfleet bench accuracy` for SmolLM2-135M-Instruct on the GPU, in device calls that carry at most
# 64 MiB each (a part of 48 MiB, the server wheels and the tree). What travels is only what cannot be made there: the embedded GGUF (Q4_1), the
# `gguf` and `accelerate` wheels (transformers' GGUF reader needs both) and, for SET=all,
# llm-compressor's GPTQ W4A16 checkpoint without its bf16 embedding (llmcompressor is not on the
# device machine; the embedding is not quantized, so it is taken back from the bf16 directory
# made there); for SET=kv, the GGUF's fp8 KV calibration file.
#   here:    SET=all: python -m kvfleet_engine.bench.quantize_smollm2 --schemes gptq-w4a16
#            SET=kv:  python -m kvfleet_engine.bench.calibrate_kv $GGUF (the file beside it)
#            WHEELS=DIR SET=... bench/gpu_accuracy.sh pack   (.whl/acc/all/part.NN + SHA256SUMS)
#   device:  put one part at a time into .whl/acc/p (git-ignored: carry [".whl"]) and run
#            `bench/gpu_accuracy.sh stage` (kept in /root/kvfleet-acc while the machine stays warm,
#            so the calls go back to back); the last call puts the last part and SHA256SUMS there
#            and runs `SET=... bench/gpu_accuracy.sh`: checks and unpacks the parts, and compares on
#            the same text and prompts, SET=all (the default; it first makes the bf16 directory
#            from the GGUF with transformers and puts the embedding back into the GPTQ checkpoint):
#              bf16    the GGUF dequantized to bf16 (the baseline)
#              fp8kv   bf16 weights, fp8 KV cache               (bound +0.5%)
#              fp8     bf16 quantized to fp8 W8A8 at load       (bound +1.5%)
#              int8    bf16 quantized to int8 W8A16 at load     (bound +1.5%)
#              gptq    llm-compressor GPTQ W4A16 group 64       (bound +8%)
#              q4_1    the GGUF itself, kept int4 group 32 on the GPU (what bf16 was made from)
#            SET=kv:
#              q4_1      the GGUF with its own (bf16) KV cache (the baseline)
#              fp8kv     the GGUF, fp8 KV cache rounded to nearest         (bound +0.5%)
#              fp8kvcal  the GGUF, fp8 KV cache rounded by the calibration (bound +0.5%)
# ACCURACY_ARGS adds arguments (e.g. "--max-tokens 8192" for a quick run); ACC_DEVICE (default
# cuda) is the bench's --device. JSON and log to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-accuracy}
STAGE=/root/kvfleet-acc
SET=${SET:-all}
PARTS=.whl/acc/p
MODELS=${KVFLEET_CACHE_DIR:-$HOME/.cache/kvfleet}/models
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
stage() { mkdir -p "$STAGE" && cp "$PARTS"/part.* "$STAGE"/ 2>/dev/null; ls -la "$STAGE"; }
case "${1:-run}" in
  pack)
    # the gguf and accelerate wheels, and pyyaml and psutil (accelerate's) for Python 3.12
    WHEELS=${WHEELS:?WHEELS: a folder holding the wheels to install on the device}
    work=$(mktemp -d) && mkdir -p "$work/models" "$work/wheels" || exit 1
    cp "$WHEELS"/*.whl "$work/wheels/" && ln -s "$MODELS/$GGUF" "$work/models/$GGUF" || exit 1
    if [ "$SET" = kv ]; then
      cp "$MODELS/$GGUF.kv-calibration.safetensors" "$work/models/" || exit 1
    else
      mkdir -p "$work/models/smollm2-gptq-w4a16" || exit 1
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
    fi
    mkdir -p .whl/acc/all && rm -f .whl/acc/all/part.*
    tar -C "$work" -chf - models wheels | split -b 48M -d - .whl/acc/all/part.
    (cd .whl/acc/all && sha256sum part.* > SHA256SUMS && cat SHA256SUMS)
    rm -rf "$work"; exit 0 ;;
  stage) stage; exit 0 ;;
esac
stage
mkdir -p "$OUT" /tmp/kvc
export PYTHONPATH="/tmp/site:$PWD/engine:$PWD/operator" PYTHONUNBUFFERED=1 KVFLEET_CACHE_DIR=/tmp/kvc
(cd "$STAGE" && sha256sum -c "$OLDPWD/$PARTS/SHA256SUMS") || exit 1
cat "$STAGE"/part.* | tar -C /tmp/kvc -xf - || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/kvc/wheels/*.whl \
  || exit 1
M=/tmp/kvc/models
if [ "$SET" = kv ]; then
  G="$M/$GGUF"
  CONFIGS=(--config "q4_1=$G" --config "fp8kv=$G:kv_cache_dtype=fp8"
    --config "fp8kvcal=$G:kv_cache_dtype=fp8,kv_cache_calibration=$G.kv-calibration.safetensors")
  BOUNDS=(--bound fp8kv=0.5 --bound fp8kvcal=0.5)
else
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
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "=== bench accuracy ($(date +%T))"
timeout -k 5 "${STEP_TIMEOUT:-480}" python3 -m kvfleet_cli.main bench accuracy \
  --device "${ACC_DEVICE:-cuda}" "${CONFIGS[@]}" "${BOUNDS[@]}" ${ACCURACY_ARGS:-} --output "$OUT" 2>&1 \
  | tee "$OUT/accuracy.log" | grep -v -i 'warn\|it/s\]' | tail -30
echo "=== done ($(date +%T))"
