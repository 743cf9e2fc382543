#!/usr/bin/env bash
# The H200 figures issues 13 and 16 still lack for this tree, one device call each (run tool,
# kind nvidia-h200, carry [".whl"]; each step under its own cap so a slow one cannot take the
# call's 600 s). The steps come in the order the issues' targets need them; on an H100 the
# ratios hold, the absolute targets (17,744, 14,600) do not apply.
#   bash bench/gpu_h200_figures.sh offline  # 1000 x (1k in, 1k out): fp8 weights + fp8 cache
#                                           # (17,744), bf16, bf16 weights + fp8 cache (1.15x)
#   bash bench/gpu_h200_figures.sh quant    # 64 x 3,968 prompts bf16 / fp8 (1.5x); batch-1
#                                           # bf16 / fp8 / int8 / awq / gptq; fp8-cache kernels
#   bash bench/gpu_h200_figures.sh serve    # issue 16's served loads (bench/gpu_serve_core.sh)
#   bash bench/gpu_h200_figures.sh budget   # c64 / c256 / shared prefix (serve_client.py) with
#                                           # the step's token budget at 8,192 (the default),
#                                           # then 16,384: c64's TPOT against its TTFT p99
#   bash bench/gpu_h200_figures.sh gemm     # the 8B layer's bf16 products at 64-512 rows:
#                                           # cuBLAS against kvfleet's TMA GEMM
#                                           # (bench/bf16_gemm_probe.py, writing the plans where
#                                           # it wins), then one decode step at 256 x 640 (c256's)
#                                           # with and without those plans (bench.profile)
#                                           # (QUICK=1: 8 TMA shapes instead of 45)
#   bash bench/gpu_h200_figures.sh autotune # Inductor's max-autotune choice at 256 rows
#                                           # (bench/bf16_autotune_probe.py)
#   bash bench/gpu_h200_figures.sh splits   # the decode attention's splits (NOTES section 31):
#                                           # the shared-prefix step at 64 / 256 sequences with
#                                           # 1-4 splits and its own tokens alone, then c256's
#                                           # attention (256 x 640, bf16) swept, then autotune
#                                           # at 256 rows (≈ 7 minutes)
#   AB_TREE=.ab/old bash bench/gpu_h200_figures.sh prefix  # the shared-prefix step (NOTES
#                                           # section 32): bf16 then fp8 cache, 16 / 64 / 256
#                                           # sequences, the prefix kernel's splits forced to
#                                           # 1-8 with each one's kernels, with PDL and without
#                                           # (the pair apart); AB_TREE's engine (`git archive
#                                           # REV engine | tar -x -C .ab/old`) after each, the
#                                           # mixed step's prefix splits; then the kernels' GPU
#                                           # tests
#   AB_TREE=.ab/old bash bench/gpu_h200_figures.sh targets  # issue 16's open served targets
#                                           # (c64, c256 after c64, shared prefix; c64 and the
#                                           # shared prefix from bench serve too) from one
#                                           # server of this tree, then the shared-prefix load
#                                           # from AB_TREE's (≈ 5.5 minutes)
#   AB_TREE=.ab/old bash bench/gpu_h200_figures.sh prefix-serve  # the engine's shared-prefix
#                                           # GPU tests, the step at 64 / 128 sequences, then
#                                           # the served shared-prefix load from this tree and
#                                           # AB_TREE's (engine and operator) (≈ 6 minutes)
# A 1k/1k run took 150-170 s on the H200 (model build, graphs, ~90 s of generation); on an H100
# one passed 195 s (session 32: ~40 s to the first request, ~140 s of generation), so there
# `offline` runs two of the three (RUNS="..." names others; the bf16 figure of session 32 is
# 2026-12-06-nvidia-h100-throughput-1k-bf16-session32.json). JSON and logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-h200-figures}
export OUT
case ${1:-} in
  offline)  # an H100 takes up to 270 s a run: two runs a call there (RUNS picks them)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then
      cap=280 runs="throughput-1k-fp8-fp8kv throughput-1k-fp8kv"
    else
      cap=195 runs="throughput-1k-fp8-fp8kv throughput-1k-bf16 throughput-1k-fp8kv"
    fi
    # shellcheck disable=SC2086  # the runs are words
    STEP_TIMEOUT=${STEP_TIMEOUT:-$cap} bash bench/gpu_decode_attention_ab.sh ${RUNS:-$runs} ;;
  quant)
    STEP_TIMEOUT=200 OUT=$OUT/prompt bash bench/gpu_fp8_prompt.sh prompt
    STEP_TIMEOUT=240 OUT=$OUT/latency bash bench/gpu_quant.sh latency
    STEP_TIMEOUT=120 OUT=$OUT/kernels bash bench/gpu_decode_attention_ab.sh kernels ;;
  serve) bash bench/gpu_serve_core.sh ;;
  budget)  # two servers, one after the other, in one lease (≈ 3 min each)
    for tokens in 8192 16384; do
      CLIENT_LOADS="c64 c256 shared" BENCH_SERVE=0 OFFLINE=0 OUT=$OUT/budget-$tokens \
        SERVE_ARGS="--max-num-batched-tokens $tokens" bash bench/gpu_serve_core.sh
    done ;;
  gemm)
    mkdir -p "$OUT"
    source bench/device_env.sh
    (cd bench && timeout -k 5 300 python3 bf16_gemm_probe.py --rows 64 128 256 512 \
      --kernels tma ${QUICK:+--quick} --output "$OUT/bf16-gemm-probe.json" \
      --write-plans "$OUT/tma-plans.json") 2>&1 | tee "$OUT/bf16-gemm-probe.log" \
      | grep -v Warning | tail -22
    for plans in none "$OUT/tma-plans.json"; do
      if [ "$plans" != none ]; then  # no file (the probe failed or ran out of time): no run
        [ -f "$plans" ] || { echo "no $plans: the probe wrote no plans" >&2; break; }
        export KVFLEET_QUANT_PLANS=$plans  # the baked quantized plans, and these
      fi
      timeout -k 5 150 python3 -m kvfleet_engine.bench.profile --batch-sizes 64,256 \
        --context 640 --output-dir "$OUT/profile-${plans##*/}" 2>&1 | grep -v Warning | tail -14
    done ;;
  autotune)
    mkdir -p "$OUT"
    source bench/device_env.sh
    (cd bench && timeout -k 5 480 python3 bf16_autotune_probe.py --rows 256 512 128 \
      --output "$OUT/bf16-autotune-probe.json") 2>&1 | tee "$OUT/bf16-autotune-probe.log" \
      | grep -v Warning | tail -40 ;;
  splits)
    mkdir -p "$OUT"
    source bench/device_env.sh
    timeout -k 5 130 python3 -m kvfleet_engine.bench.shared_prefix --seqs 64 256 --context 2112 \
      --prefix 1536 --splits 1 2 3 4 --output "$OUT/shared-prefix-splits-bf16.json" 2>&1 \
      | grep -v Warning | tail -4
    timeout -k 5 110 python3 -m kvfleet_engine.bench.kernels --num-seqs 256 --context 640 \
      --kv-cache-dtype auto --cases decode --output-dir "$OUT" 2>&1 | grep -v Warning | tail -22
    (cd bench && timeout -k 5 190 python3 bf16_autotune_probe.py --rows 256 \
      --output "$OUT/bf16-autotune-probe.json") 2>&1 | grep -v Warning | tail -14 ;;
  prefix)
    mkdir -p "$OUT"
    source bench/device_env.sh
    new_path=$PYTHONPATH old_path=${AB_TREE:+/tmp/site:$(cd "$AB_TREE" && pwd)/engine}
    problem="--seqs 16 64 256 --context 2112 --prefix 1536"
    for cache in bf16 fp8; do
      flag=${cache/bf16/}; flag=${flag:+--fp8}
      for pdl in default 0; do  # KVFLEET_PDL=0: the prefix kernel and the split kernel apart
        echo "--- this tree, KVFLEET_PDL=$pdl"
        # shellcheck disable=SC2086  # the problem's words
        PYTHONPATH=$new_path KVFLEET_PDL=${pdl/default/} timeout -k 5 150 python3 -m \
          kvfleet_engine.bench.shared_prefix $problem $flag --prefix-splits 1 2 4 8 \
          --output "$OUT/shared-prefix-$cache-pdl-$pdl.json" 2>&1 | grep -v Warning | tail -18
      done
      if [ -n "$old_path" ]; then
        echo "--- AB_TREE's engine ($AB_TREE)"
        # shellcheck disable=SC2086
        PYTHONPATH=$old_path timeout -k 5 100 python3 -m kvfleet_engine.bench.shared_prefix \
          $problem $flag --output "$OUT/shared-prefix-$cache-old.json" 2>&1 \
          | grep -v Warning | tail -6
      fi
      # a step with a prompt chunk as the engine runs it, the mixed prefix splits (4) forced
      # shellcheck disable=SC2086
      PYTHONPATH=$new_path timeout -k 5 100 python3 -m kvfleet_engine.bench.shared_prefix \
        --seqs 16 64 --context 2112 --prefix 1536 --mixed 512 $flag --prefix-splits 2 4 8 \
        --output "$OUT/shared-prefix-mixed-$cache.json" 2>&1 | grep -v Warning | tail -3
      [ "$cache" = bf16 ] && PYTHONPATH=$new_path timeout -k 5 200 python3 -m pytest -m gpu \
        tests/kernels/test_triton_kernels.py tests/kernels/test_kv_fp8.py \
        tests/kernels/test_pdl.py -q -p no:cacheprovider -k "prefix or mixed or pdl" 2>&1 | tail -4
    done ;;
  prefix-serve)  # the engine's shared-prefix GPU tests (CUDA graphs), the step at 64 / 128
    # / 256 sequences, then the served shared-prefix load (c64, 256 x 2,048 -> 128, 1,536 shared)
    # from this tree and from AB_TREE's (engine and operator), one server after the other
    mkdir -p "$OUT"
    ( source bench/device_env.sh
      timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu.py \
        -k "shared_prefix or graphs_on_and_off" 2>&1 | tail -3
      timeout -k 5 120 python3 -m kvfleet_engine.bench.shared_prefix --seqs 64 128 256 \
        --context 2112 --prefix 1536 --prefix-splits 1 4 \
        --output "$OUT/shared-prefix-bf16.json" 2>&1 | grep -v Warning | tail -12 )
    KERNEL=0 SETTINGS=shared-prefix-attention LOADS="64 256 2048 128 1536" OUT=$OUT/serve \
      bash bench/gpu_shared_prefix.sh 2>&1 | tail -12 ;;
  targets)  # issue 16's open served targets from one server of this tree (c64, c256 after
    # c64, the shared prefix; then c64 and the shared prefix from kvfleet bench serve), then
    # the shared-prefix load from AB_TREE's (its engine and operator, this tree's bench/), one
    # server after the other (≈ 5.5 minutes). AB_LOADS: AB_TREE's serve_client.py loads
    # (default: shared), AB_CAP its cap in seconds (240); BENCH_LOADS=none: no bench serve
    # loads from this tree's server (default: c64 shared)
    wheels=$(cd "${WHEELS:-.whl/server}" && pwd)
    CLIENT_LOADS="c64 c256 shared" BENCH_LOADS=${BENCH_LOADS:-c64 shared} OFFLINE=0 WHEELS=$wheels \
      OUT=$OUT/new timeout -k 5 330 bash bench/gpu_serve_core.sh 2>&1 | grep -v Warning \
      | tail -16
    if [ -n "${AB_TREE:-}" ]; then
      ln -sfn "$PWD/bench" "$AB_TREE/bench"
      (cd "$AB_TREE" && CLIENT_LOADS=${AB_LOADS:-shared} BENCH_SERVE=0 OFFLINE=0 WHEELS=$wheels \
        OUT=$OUT/old timeout -k 5 "${AB_CAP:-240}" bash bench/gpu_serve_core.sh 2>&1 \
        | grep -v Warning \
        | tail -6)
    fi ;;
  *) echo "usage: bash bench/gpu_h200_figures.sh offline|quant|serve|budget|gemm|autotune|splits|prefix|prefix-serve|targets" >&2
     exit 2 ;;
esac
