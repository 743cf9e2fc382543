#!/usr/bin/env bash
# One device call (run tool), ~3 minutes: Nsight Compute on the paged decode attention kernel over
# a bf16 and an fp8 cache (512 sequences x 1.5k context, Llama-3.1-8B heads: the 1k/1k workload's
# decode), or on a batch-1 quantized product (cases int4-gemv, int8-gemv, fp8-gemv: Llama-3.1-8B's
# gate_up, x [1, 4096] @ [4096, 28672], with the engine's plan), with the compiled kernels kept.
# What comes back under $OUT:
#   <case>.txt         ncu's details page (speed of light, memory workload, occupancy, launch
#                      statistics, warp states: registers, shared memory, stall reasons)
#   <case>-sass.csv    ncu's source page: each SASS instruction with its stall samples
#   triton-cache.tgz   the kernels' TTGIR, PTX and cubin, to read here
# CASES (default "bf16 fp8") and DECODE_ARGS (JSON kwargs for paged_decode_attention, e.g.
# '{"block_n": 128}') pick what is profiled; NUM_SEQS and CONTEXT the size; V_LAYOUT (tokens,
# the engine's, or rows) the fp8 cache's V layout.
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-decode-profile}
mkdir -p "$OUT"
source bench/device_env.sh
export TRITON_CACHE_DIR="$OUT/triton-cache"
DRIVER=$(mktemp --suffix=.py)
cat > "$DRIVER" <<'PY'
import json, os, sys
import torch
import triton.testing
from kvfleet_engine.bench.kernels import _kv_bytes, _paged_kv
from kvfleet_engine.kernels import paged_decode_attention
from kvfleet_engine.kernels.checks import to_token_major

if sys.argv[1].endswith("-gemv"):  # one quantized product, timed alone
    from kvfleet_engine.bench import quant_gemv
    fmt = sys.argv[1].removesuffix("-gemv")
    variant = {"int4": "int4-g128", "int8": "int8", "fp8": "fp8"}[fmt]
    weights = quant_gemv.make_weights(fmt, 28672, 4096, torch.device("cuda"))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    product = quant_gemv.VARIANTS[variant][1]
    for _ in range(6):
        product(x, weights)
    torch.cuda.synchronize()
    if os.environ.get("TIME", "1") == "1":
        ms = triton.testing.do_bench(lambda: product(x, weights), warmup=25, rep=100)
        moved = sum(t.numel() * t.element_size() for t in weights)
        print(f"{variant} gate_up 1 row: {ms * 1e3:.1f} us, {moved / ms / 1e6:.0f} GB/s")
    sys.exit(0)
fp8 = sys.argv[1] == "fp8"
num_seqs, context = int(os.environ.get("NUM_SEQS", 512)), int(os.environ.get("CONTEXT", 1536))
kwargs = json.loads(os.environ.get("DECODE_ARGS") or "{}")
k, v, tables, lens, scales = _paged_kv(num_seqs, context, 8, 128, 16, fp8)
if fp8 and os.environ.get("V_LAYOUT", "tokens") == "tokens":  # the engine's fp8 V layout
    v = to_token_major(v)
q = torch.randn(num_seqs, 32, 128, device="cuda", dtype=torch.bfloat16)
run = lambda: paged_decode_attention(q, k, v, tables, lens, 128**-0.5, **scales, **kwargs)
for _ in range(6):
    run()
torch.cuda.synchronize()
if os.environ.get("TIME", "1") == "1":
    ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
    gbs = _kv_bytes(num_seqs * context, 8, 128, fp8) / ms / 1e6
    print(f"{sys.argv[1]} {kwargs} {num_seqs}x{context}: {ms * 1e3:.1f} us, {gbs:.0f} GB/s")
PY
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for case in ${CASES:-bf16 fp8}; do
  echo "=== $case ($(date +%T))"
  python3 "$DRIVER" "$case" 2>&1 | grep -v Warning
  [ -n "$NCU" ] || continue
  case $case in *-gemv) kernel=regex:gemv ;; *) kernel=regex:decode_split_kernel ;; esac
  TIME=0 timeout -k 5 240 "$NCU" --clock-control none -k "$kernel" \
    --launch-skip 3 --launch-count 1 --set full --import-source yes -f -o "$OUT/$case" \
    python3 "$DRIVER" "$case" > "$OUT/$case-ncu.log" 2>&1 || tail -5 "$OUT/$case-ncu.log"
  "$NCU" --import "$OUT/$case.ncu-rep" --page details > "$OUT/$case.txt" 2>&1
  "$NCU" --import "$OUT/$case.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/$case-sass.csv" 2>&1 || true
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Shared Memory Config|Dynamic Shared|Achieved Occupancy|Theoretical Occupancy|Block Limit|L1/TEX Hit|L2 Hit|Issue Slots|No Eligible|Warp Cycles Per Issued" \
    "$OUT/$case.txt" | head -30
done
tar -C "$OUT" -czf "$OUT/triton-cache.tgz" triton-cache && rm -rf "$OUT/triton-cache"
rm -f "$OUT"/*.ncu-rep.tmp "$DRIVER"
ls -la "$OUT" | head -20
echo "=== done ($(date +%T))"
