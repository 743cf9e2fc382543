"""Decode attention over a shared prefix against reading it per sequence, on the GPU: one
layer of an 8B model's decode attention (32 query heads, 8 kv heads, head_dim 128; a bf16 cache,
or with --fp8 an e4m3 one laid out as the engine allocates it), every sequence `--context`
tokens of which the first `--prefix` are the same cache blocks; each variant's output checked
against the other, then timed from a CUDA graph.

  python -m kvfleet_engine.bench.shared_prefix --seqs 16 64 256 --context 2048 --prefix 1536 \\
      [--fp8] --output results.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from kvfleet_engine.bench.gemv import graph_seconds
from kvfleet_engine.kernels import paged_decode_attention
from kvfleet_engine.kernels.checks import to_token_major
from kvfleet_engine.layers.attention_torch import quantize_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def case(seqs: int, context: int, prefix: int, fp8: bool) -> dict:
    """The tensors of one problem: shared blocks first in every table, the rest each its own."""
    blocks = -(-context // BLOCK)
    shared = prefix // BLOCK
    own = blocks - shared
    total = shared + seqs * own
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache_shape = (total, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = [[*range(shared), *range(shared + s * own, shared + (s + 1) * own)] for s in range(seqs)]
    block_tables = torch.tensor(rows, dtype=torch.int32, device="cuda")
    described = torch.tensor([shared * BLOCK, 0, *[shared * BLOCK] * seqs], dtype=torch.int32)
    scales = {}
    if fp8:  # codes, per-token scales [blocks, kv heads, block], V token major (`kv_memory`)
        (k_cache, k_scales), (v_cache, v_scales) = quantize_kv(k_cache), quantize_kv(v_cache)
        v_cache = to_token_major(v_cache)
        scales = {
            "k_scales": k_scales.transpose(1, 2).contiguous(),
            "v_scales": v_scales.transpose(1, 2).contiguous(),
        }
    return {
        "query": torch.randn(seqs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "context_lens": torch.full((seqs,), context, dtype=torch.int32, device="cuda"),
        "shared_prefix": described.cuda(),
        "scales": scales,
    }


def measure(seqs: int, context: int, prefix: int, fp8: bool) -> dict:
    tensors = case(seqs, context, prefix, fp8)
    shared, scales = tensors.pop("shared_prefix"), tensors.pop("scales")
    args = (*tensors.values(), HEAD_DIM**-0.5)

    def plain() -> torch.Tensor:
        return paged_decode_attention(*args, **scales)

    def with_prefix() -> torch.Tensor:
        return paged_decode_attention(*args, **scales, shared_prefix=shared)

    want, got = plain().float(), with_prefix().float()
    error = float((got - want).norm() / want.norm())
    plain_us, shared_us = _microseconds(plain), _microseconds(with_prefix)
    kv_token_bytes = 2 * KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
    return {
        "cache": "fp8" if fp8 else "bf16",
        "seqs": seqs,
        "context": context,
        "prefix": prefix,
        "relative_error": error,
        "per_sequence_us": round(plain_us, 1),
        "shared_prefix_us": round(shared_us, 1),
        "speedup": round(plain_us / shared_us, 2),
        "per_sequence_gb_s": round(seqs * context * kv_token_bytes / plain_us / 1e3, 1),
    }


def _microseconds(step: Callable[[], torch.Tensor]) -> float:
    def call() -> None:
        step()

    return graph_seconds(call) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefix", type=int, default=1536)
    parser.add_argument("--fp8", action="store_true", help="an e4m3 cache (kv_cache_dtype=fp8)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if args.prefix >= args.context or args.prefix % BLOCK:
        parser.error(f"--prefix must be a multiple of {BLOCK} below --context")
    rows = [measure(seqs, args.context, args.prefix, args.fp8) for seqs in args.seqs]
    print(f"{'seqs':>5} {'per sequence us':>16} {'shared us':>10} {'speedup':>8} {'rel err':>9}")
    for row in rows:
        print(
            f"{row['seqs']:>5} {row['per_sequence_us']:>16} {row['shared_prefix_us']:>10} "
            f"{row['speedup']:>8} {row['relative_error']:>9.2e}"
        )
    if args.output:
        args.output.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
