"""Kernel microbenchmark: the paged decode attention kernel (64 sequences × 4k context, Llama-3.1-8B
heads, bf16) against the measured copy bandwidth, over a few tile/split/warp settings; plus
batch-1 decode at 4k and a prefill step.

    python -m kvfleet_engine.bench.kernels --output-dir bench/results
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch


def _paged_kv(num_seqs: int, context: int, num_kv_heads: int, head_dim: int, block_size: int):
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
    block_tables = order.view(num_seqs, blocks_per_seq).contiguous()
    context_lens = torch.full((num_seqs,), context, device="cuda", dtype=torch.int32)
    return k_cache, v_cache, block_tables, context_lens


def main(argv: list[str] | None = None) -> int:
    import triton.testing

    from kvfleet_engine.bench.results import Row, format_table, gpu_name, write_results
    from kvfleet_engine.bench.roofline import measure_ceilings
    from kvfleet_engine.kernels import paged_decode_attention, prefill_attention

    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.kernels")
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
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

    def decode_case(num_seqs: int, context: int, label: str, variants: list[dict]) -> None:
        k_cache, v_cache, block_tables, context_lens = _paged_kv(
            num_seqs, context, num_kv_heads, head_dim, block_size
        )
        query = torch.randn(num_seqs, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        kv_bytes = 2 * num_seqs * context * num_kv_heads * head_dim * 2
        best = None
        for variant in variants:
            ms = triton.testing.do_bench(
                lambda v=variant: paged_decode_attention(
                    query, k_cache, v_cache, block_tables, context_lens, scale, **v
                ),
                warmup=25,
                rep=100,
                return_mode="median",
            )
            fraction = kv_bytes / (ms * 1e-3) / bw
            lines.append(
                f"{label:<24} {variant!s:<58} {ms * 1e3:9.1f} us  {fraction:6.1%} of copy BW"
            )
            if best is None or ms < best[0]:
                best = (ms, variant, fraction)
        assert best is not None
        rows.append(Row("kvfleet", f"{label}_us", best[0] * 1e3, "us"))
        rows.append(Row("kvfleet", f"{label}_bandwidth_fraction", best[2], "fraction"))
        lines.append(f"{label}: best {best[1]}")

    sweep = [
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
    decode_case(args.num_seqs, args.context, "decode_64x4k", sweep)
    decode_case(1, args.context, "decode_1x4k", [{}, {"block_n": 32}, {"num_splits": 64}])

    # Prefill: 8 prompts of 1024 tokens, compute-bound: report TFLOP/s (causal: half the square).
    num_seqs, q_len = 8, 1024
    k_cache, v_cache, block_tables, _ = _paged_kv(
        num_seqs, q_len, num_kv_heads, head_dim, block_size
    )
    query = torch.randn(
        num_seqs * q_len, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16
    )
    cu = torch.arange(0, (num_seqs + 1) * q_len, q_len, device="cuda", dtype=torch.int32)
    lens = torch.full((num_seqs,), q_len, device="cuda", dtype=torch.int32)
    flops = num_seqs * num_q_heads * 4 * head_dim * q_len * q_len / 2
    best_ms = float("inf")
    for variant in [{}, {"block_m": 128}, {"block_m": 128, "num_warps": 8}]:
        ms = triton.testing.do_bench(
            lambda v=variant: prefill_attention(
                query, k_cache, v_cache, block_tables, cu, lens, scale, **v
            ),
            return_mode="median",
        )
        lines.append(
            f"prefill_8x1k {variant!s:<40} {ms * 1e3:9.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s"
        )
        best_ms = min(best_ms, ms)
    rows.append(Row("kvfleet", "prefill_8x1k_tflops", flops / best_ms / 1e9, "TFLOP/s"))

    print("\n".join(lines))
    command = "python -m kvfleet_engine.bench.kernels " + shlex.join(argv or sys.argv[1:])
    workload = {
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": "bfloat16",
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
