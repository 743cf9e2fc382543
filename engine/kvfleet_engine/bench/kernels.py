"""Kernel microbenchmark: the paged decode attention kernel (64 sequences × 4k context, Llama-3.1-8B
heads, bf16 queries) against the measured copy bandwidth, over a few tile/split/warp settings;
plus batch-1 decode at 4k and a prefill step. Each runs over a bf16 cache and over the quantized
ones (e4m3 or int8 codes + a bf16 scale per token and kv head, `kernels/kv_fp8.py`): the KV bytes
a decode step reads (scales included) per second, against copy bandwidth, and the speed-up of
each over bf16.

    python -m kvfleet_engine.bench.kernels --output-dir bench/results [--kv-cache-dtype int8] \\
        [--cases decode prefill]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch


def _paged_kv(
    num_seqs: int, context: int, num_kv_heads: int, head_dim: int, block_size: int, cache: str
):
    """Random K/V in shuffled blocks: bf16 (cache "auto"), or quantized to e4m3 ("fp8") or int8
    codes with their scales."""
    from kvfleet_engine.layers.attention_torch import KV_CODES, quantize_kv

    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    scales: dict[str, torch.Tensor] = {}
    if cache != "auto":  # scales [num_blocks, num_kv_heads, block_size]
        k_cache, k_scales = quantize_kv(k_cache, KV_CODES[cache])
        v_cache, v_scales = quantize_kv(v_cache, KV_CODES[cache])
        scales = {
            "k_scales": k_scales.transpose(1, 2).contiguous(),
            "v_scales": v_scales.transpose(1, 2).contiguous(),
        }
    order = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
    block_tables = order.view(num_seqs, blocks_per_seq).contiguous()
    context_lens = torch.full((num_seqs,), context, device="cuda", dtype=torch.int32)
    return k_cache, v_cache, block_tables, context_lens, scales


def _split_layout(variant: dict, fp8: bool) -> tuple[dict, str]:
    """A variant's launch arguments, and its "v_layout": the V cache in K's row layout or token
    major (the same values). Default: the engine's (token major for fp8 since 2026-12-02)."""
    launch = {key: value for key, value in variant.items() if key != "v_layout"}
    return launch, variant.get("v_layout", "tokens" if fp8 else "rows")


def _kv_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, fp8: bool) -> int:
    """K and V of num_tokens tokens: bf16 rows, or 8-bit rows and a 2-byte scale each."""
    row = head_dim + 2 if fp8 else 2 * head_dim
    return 2 * num_tokens * num_kv_heads * row


def main(argv: list[str] | None = None) -> int:
    import triton.testing
    from triton.runtime.errors import OutOfResources

    from kvfleet_engine.bench.results import Row, format_table, gpu_name, write_results
    from kvfleet_engine.bench.roofline import measure_ceilings
    from kvfleet_engine.kernels import paged_decode_attention, prefill_attention
    from kvfleet_engine.kernels.checks import to_token_major

    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.kernels")
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("all", "auto", "fp8", "int8"),
        default="all",
        help="cache of the runs: bf16 (auto), fp8, int8, or the three (all)",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=("decode", "prefill"),
        default=["decode", "prefill"],
        help="which kernels to time (default: both)",
    )
    parser.add_argument(
        "--engine-only",
        action="store_true",
        help="time only what the engine launches (no sweep of tiles, splits and warps)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel microbenchmarks need a CUDA GPU")
        return 2
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    bw = ceilings.bandwidth
    num_q_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    scale = head_dim**-0.5
    rows = [Row("roofline", "copy_bandwidth", bw / 1e9, "GB/s")]
    lines = []

    def decode_case(
        num_seqs: int, context: int, label: str, variants: list[dict], cache: str
    ) -> float:
        """Best time (ms) over the variants; rows for the best and for the engine's settings."""
        fp8 = cache != "auto"  # a quantized cache (fp8 or int8)
        k_cache, v_cache, block_tables, context_lens, scales = _paged_kv(
            num_seqs, context, num_kv_heads, head_dim, block_size, cache
        )
        query = torch.randn(num_seqs, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        kv_bytes = _kv_bytes(num_seqs * context, num_kv_heads, head_dim, fp8)
        v_caches = {"rows": v_cache, **({"tokens": to_token_major(v_cache)} if fp8 else {})}
        best = None
        for variant in variants:
            launch, v_layout = _split_layout(variant, fp8)
            try:
                ms = triton.testing.do_bench(
                    lambda v=launch, values=v_caches[v_layout]: paged_decode_attention(
                        query, k_cache, values, block_tables, context_lens, scale, **scales, **v
                    ),
                    warmup=25,
                    rep=100,
                    return_mode="median",
                )
            except OutOfResources as error:  # a tile too large for shared memory
                lines.append(f"{label:<24} {variant!s:<58} skipped: {error}")
                continue
            fraction = kv_bytes / (ms * 1e-3) / bw
            lines.append(
                f"{label:<24} {variant!s:<58} {ms * 1e3:9.1f} us  "
                f"{kv_bytes / ms / 1e6:7.0f} GB/s  {fraction:6.1%} of copy BW"
            )
            if variant == {}:  # what the engine launches
                rows.append(
                    Row("kvfleet", f"{label}_default_bandwidth_fraction", fraction, "fraction")
                )
            elif variant == {"v_layout": "rows"}:  # the A/B of the V layout, same run
                rows.append(
                    Row("kvfleet", f"{label}_v_rows_bandwidth_fraction", fraction, "fraction")
                )
            if best is None or ms < best[0]:
                best = (ms, variant, fraction)
        assert best is not None
        rows.append(Row("kvfleet", f"{label}_us", best[0] * 1e3, "us"))
        rows.append(Row("kvfleet", f"{label}_gbps", kv_bytes / best[0] / 1e6, "GB/s"))
        rows.append(Row("kvfleet", f"{label}_bandwidth_fraction", best[2], "fraction"))
        lines.append(f"{label}: best {best[1]}")
        return best[0]

    def prefill_case(label: str, cache: str, variants: list[dict]) -> float:
        """8 prompts of 1024 tokens, compute-bound: TFLOP/s (causal: half the square)."""
        num_seqs, q_len = 8, 1024
        fp8 = cache != "auto"  # a quantized cache (fp8 or int8)
        k_cache, v_cache, block_tables, _, scales = _paged_kv(
            num_seqs, q_len, num_kv_heads, head_dim, block_size, cache
        )
        query = torch.randn(
            num_seqs * q_len, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16
        )
        cu = torch.arange(0, (num_seqs + 1) * q_len, q_len, device="cuda", dtype=torch.int32)
        lens = torch.full((num_seqs,), q_len, device="cuda", dtype=torch.int32)
        flops = num_seqs * num_q_heads * 4 * head_dim * q_len * q_len / 2
        v_caches = {"rows": v_cache, **({"tokens": to_token_major(v_cache)} if fp8 else {})}
        best_ms, best = float("inf"), {}
        for variant in variants:
            launch, v_layout = _split_layout(variant, fp8)
            try:
                ms = triton.testing.do_bench(
                    lambda v=launch, values=v_caches[v_layout]: prefill_attention(
                        query, k_cache, values, block_tables, cu, lens, scale, **scales, **v
                    ),
                    return_mode="median",
                )
            except OutOfResources as error:
                lines.append(f"{label} {variant!s:<40} skipped: {error}")
                continue
            lines.append(
                f"{label} {variant!s:<58} {ms * 1e3:9.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s"
            )
            if variant == {}:  # what the engine launches
                rows.append(Row("kvfleet", f"{label}_default_tflops", flops / ms / 1e9, "TFLOP/s"))
            if ms < best_ms:
                best_ms, best = ms, variant
        rows.append(Row("kvfleet", f"{label}_tflops", flops / best_ms / 1e9, "TFLOP/s"))
        lines.append(f"{label}: best {best}")
        return best_ms

    sweep: list[dict] = [
        {},
        {"block_n": 32},
        {"block_n": 128},
        {"num_splits": 1},
        {"num_splits": 2},
        {"num_splits": 4},
        {"block_n": 64, "num_warps": 8},
        {"block_n": 128, "num_warps": 8},
        {"block_n": 32, "num_stages": 3},
        {"block_n": 64, "num_stages": 3},
        {"block_n": 16, "num_warps": 2},
    ]
    # fp8: the engine's default reads a token-major V cache (its codes go through shared memory
    # as K's do) over 32-token tiles, 16 where its programs fill two waves
    # (`decode_plan.token_major_fp8_tile`), loads the next tile's scales during this one
    # (prefetch_scales) except over 16-token tiles, and takes scores as q @ K^T; the sweep
    # measures the V cache in K's row layout (converted to float16 before shared memory,
    # early_v), the scales loaded the other way, other tiles, pipelines and warps (fewer warps:
    # fewer cross-warp reductions of the softmax), and the other order.
    fp8_sweep: list[dict] = [
        {},
        {"v_layout": "rows"},  # the engine's V cache before 2026-12-02 (with early_v)
        {"v_layout": "rows", "block_n": 128},
        {"prefetch_scales": False},
        {"block_n": 16, "prefetch_scales": True},
        {"block_n": 32},
        {"block_n": 128},
        {"num_splits": 2},
        {"num_stages": 3},
        {"num_stages": 4},
        {"block_n": 32, "num_stages": 4},
        {"block_n": 128, "num_stages": 3},
        {"block_n": 128, "num_warps": 8},
        {"num_warps": 2},
        {"num_warps": 1},
        {"block_n": 32, "num_warps": 1},
        {"block_n": 128, "num_warps": 2},
        {"transpose_scores": True},
        # Nsight Compute (2026-12-02): the one-warp default holds 250 registers, 8 programs an
        # SM (12.5% occupancy) with no warp eligible half the time; capped, more fit
        {"max_registers": 168},
        {"max_registers": 128},
        {"max_registers": 168, "num_splits": 2},
        {"block_n": 16},
        {"block_n": 64, "max_registers": 168},
        {"num_warps": 2, "max_registers": 128},
        # 2026-12-05: the one-warp default's splits fill whole waves (64 x 4k: 2, was 3) and it
        # rescales its accumulator only when a row's max grew; a 192-register cap measured slower
        {"num_splits": 3},
        {"lazy_rescale": False},
        {"max_registers": 192},
        {"num_splits": 3, "lazy_rescale": False},
    ]
    prefill_sweep: list[dict] = [
        {},
        {"block_m": 128},
        {"block_m": 128, "num_warps": 8},
        {"block_n": 32},
        {"block_m": 128, "block_n": 32, "num_warps": 8},
    ]
    # fp8 prefill, bound by tensor-core work: the default (token-major V, float16 dots, scales a
    # tile ahead) against V in K's row layout (converted after shared memory, or before it:
    # early_v), dots in the query dtype, and the scales loaded where used.
    fp8_prefill_sweep: list[dict] = [
        *prefill_sweep,
        {"v_layout": "rows"},
        {"v_layout": "rows", "early_v": True},
        {"f16_dots": False},
        {"f16_dots": False, "prefetch_scales": False},
        {"prefetch_scales": False},
        {"num_stages": 3},
        {"block_m": 128, "num_stages": 3},
    ]
    if args.engine_only:
        sweep = fp8_sweep = prefill_sweep = fp8_prefill_sweep = [{}]
    all_caches = ("auto", "fp8", "int8")
    caches = all_caches if args.kv_cache_dtype == "all" else (args.kv_cache_dtype,)
    big = f"decode_{args.num_seqs}x{args.context // 1024}k"
    times: dict[str, float] = {}
    prefill_times: dict[str, float] = {}
    for cache in caches:
        suffix = "" if cache == "auto" else f"_{cache}"
        quantized = cache != "auto"
        if "decode" in args.cases:
            times[cache] = decode_case(
                args.num_seqs, args.context, big + suffix, fp8_sweep if quantized else sweep, cache
            )
            one = [{}, {"block_n": 32}, {"num_splits": 64}]
            decode_case(1, args.context, f"decode_1x{args.context // 1024}k{suffix}", one, cache)
        if "prefill" in args.cases:
            prefill_times[cache] = prefill_case(
                f"prefill_8x1k{suffix}", cache, fp8_prefill_sweep if quantized else prefill_sweep
            )
    for cache in caches[1:] if "auto" in times else ():
        speedup = times["auto"] / times[cache]
        rows.append(Row("kvfleet", f"{big}_{cache}_speedup_over_bf16", speedup, "x"))
        lines.append(f"{big}: {cache} cache {speedup:.2f}x the bf16 cache's speed")
    for cache in caches[1:] if "auto" in prefill_times else ():
        prefill_ratio = prefill_times["auto"] / prefill_times[cache]
        rows.append(Row("kvfleet", f"prefill_8x1k_{cache}_speed_of_bf16", prefill_ratio, "x"))
        lines.append(f"prefill_8x1k: {cache} cache {prefill_ratio:.2f}x the bf16 cache's speed")

    print("\n".join(lines))
    command = "python -m kvfleet_engine.bench.kernels " + shlex.join(argv or sys.argv[1:])
    workload = {
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": "bfloat16",
        "kv_cache_dtypes": [
            {
                "auto": "bfloat16",
                "fp8": "fp8 (e4m3 + bfloat16 scale per token and kv head)",
                "int8": "int8 (integer codes + bfloat16 scale per token and kv head)",
            }[cache]
            for cache in caches
        ],
    }
    path = write_results(
        args.output_dir,
        "attention-kernels",
        gpu_name(device),
        command,
        "llama-3.1-8b (attention heads)",
        workload,
        rows,
    )
    print(format_table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
