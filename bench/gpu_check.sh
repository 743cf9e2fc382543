#!/usr/bin/env bash
# One device call (run tool): GPU tests, the attention-kernel microbenchmark, then the latency and
# throughput benchmarks. Logs and results JSON go to $OUT. Steps default to all; pass a subset:
#   bench/gpu_check.sh tests engine-tests kernels profile gemv latency throughput throughput-1k
# STEP_TIMEOUT (seconds, default 590) caps each step, so one call ends within the device limit.
# The engine imports msgspec and the server's packages, which the device lacks: carry .whl with
# the wheels bench/gpu_serve_core.sh lists in .whl/server (installed into /tmp/site).
# TESTS_K selects kernel tests (pytest -k); TESTS_WORKERS runs them in that many pytest-xdist
# processes on the one GPU (Triton's compiles are most of the suite's time; the pytest-xdist and
# execnet wheels go in .whl/server beside the others); GEMV_TOKENS the gemv batch sizes; PROFILE_ARGS and LATENCY_ARGS add arguments to those
# steps (e.g. PROFILE_ARGS="--batch-sizes 1 --context 192" LATENCY_ARGS="--host-trace 40").
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-check}
mkdir -p "$OUT"
source bench/device_env.sh
PY="timeout -k 5 ${STEP_TIMEOUT:-590} ${PY:-python3}"
STEPS=${*:-tests kernels profile latency throughput}
SHAPE=${SHAPE:-llama-3.1-8b}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
for step in $STEPS; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests) $PY -m pytest -m gpu tests/kernels tests/perf -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} \
        ${TESTS_WORKERS:+-n "$TESTS_WORKERS"} 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    engine-tests) $PY -m pytest -m gpu tests/engine/test_gpu.py tests/engine/test_pipeline_graphs.py \
        tests/perf/test_cuda_graphs.py tests/engine/test_quant_gpu.py \
        tests/engine/test_kv_cache_quantized.py tests/engine/test_kv_shaping.py \
        tests/engine/test_gguf_quantized.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/engine-tests.log" | tail -15 ;;
    kernels) $PY -m kvfleet_engine.bench.kernels --output-dir "$OUT" 2>&1 | tee "$OUT/kernels.log" | grep -v Warning ;;
    profile) $PY -m kvfleet_engine.bench.profile --shape "$SHAPE" ${PROFILE_ARGS:-} --output-dir "$OUT" 2>&1 \
        | grep -v Warning ;;
    gemv) $PY -m kvfleet_engine.bench.gemv --shape "$SHAPE" --tokens "${GEMV_TOKENS:-1}" \
        --output-dir "$OUT" 2>&1 | grep -v Warning ;;
    latency) $PY -m kvfleet_cli.main bench latency --shape "$SHAPE" --peer transformers \
        --output-len 128 ${LATENCY_ARGS:-} --output-dir "$OUT" 2>&1 | tee "$OUT/latency.log" \
        | grep -v 'tok/s\]' | tail -${LATENCY_TAIL:-20} ;;
    eager-latency) $PY -m kvfleet_cli.main bench latency --shape "$SHAPE" --enforce-eager \
        --output-len 128 --output-dir "$OUT/eager" 2>&1 | grep -v 'tok/s\]' | tail -14 ;;
    throughput) $PY -m kvfleet_cli.main bench throughput --shape "$SHAPE" --peer transformers \
        --peer-num-prompts "${PEER_PROMPTS:-64}" --num-prompts "${PROMPTS:-512}" \
        --max-num-seqs "${MAX_SEQS:-512}" --max-num-batched-tokens "${MAX_TOKENS:-16384}" \
        --output-dir "$OUT" 2>&1 | tee "$OUT/throughput.log" | grep -v 'it/s\]\|req/s\]' | tail -20 ;;
    throughput-1k) $PY -m kvfleet_cli.main bench throughput --shape "$SHAPE" --num-prompts 1000 \
        --input-len 1000 --output-len 1000 --max-num-seqs "${MAX_SEQS_1K:-384}" \
        --max-num-batched-tokens "${MAX_TOKENS:-16384}" --output-dir "$OUT/1k" 2>&1 \
        | tee "$OUT/throughput-1k.log" | grep -v 'it/s\]\|req/s\]' | tail -20 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
