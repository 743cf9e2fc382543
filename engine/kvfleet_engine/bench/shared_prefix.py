"""Decode attention over a shared prefix against reading it per sequence, on the GPU: one
layer of an 8B model's decode attention (32 query heads, 8 kv heads, head_dim 128, bf16 cache),
every sequence `--context` tokens of which the first `--prefix` are the same cache blocks;
each variant's output checked against the other, then timed from a CUDA graph.

  python -m kvfleet_engine.bench.shared_prefix --seqs 16 64 256 --context 2048 --prefix 1536 \\
      --output results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvfleet_engine.bench.gemv import graph_seconds
from kvfleet_engine.kernels import paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def case(seqs: int, context: int, prefix: int) -> dict:
    """The tensors of one problem: shared blocks first in every table, the rest each its own."""
    blocks = -(-context // BLOCK)
    shared = prefix // BLOCK
    own = blocks - shared
    total = shared + seqs * own
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache_shape = (total, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = [
        [*range(shared), *range(shared + s * own, shared + (s + 1) * own)] for s in range(seqs)
    ]
    block_tables = torch.tensor(rows, dtype=torch.int32, device="cuda")
    described = torch.tensor([shared * BLOCK, 0, *[shared * BLOCK] * seqs], dtype=torch.int32)
    return {
        "query": torch.randn(seqs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "context_lens": torch.full((seqs,), context, dtype=torch.int32, device="cuda"),
        "shared_prefix": described.cuda(),
    }


def measure(seqs: int, context: int, prefix: int) -> dict:
    tensors = case(seqs, context, prefix)
    shared = tensors.pop("shared_prefix")
    args = (*tensors.values(), HEAD_DIM**-0.5)

    def plain() -> torch.Tensor:
        return paged_decode_attention(*args)

    def with_prefix() -> torch.Tensor:
        return paged_decode_attention(*args, shared_prefix=shared)

    want, got = plain().float(), with_prefix().float()
    error = float((got - want).norm() / want.norm())
    plain_us = graph_seconds(lambda: plain()) * 1e6
    shared_us = graph_seconds(lambda: with_prefix()) * 1e6
    kv_token_bytes = 2 * KV_HEADS * HEAD_DIM * 2
    return {
        "seqs": seqs,
        "context": context,
        "prefix": prefix,
        "relative_error": error,
        "per_sequence_us": round(plain_us, 1),
        "shared_prefix_us": round(shared_us, 1),
        "speedup": round(plain_us / shared_us, 2),
        "per_sequence_gb_s": round(seqs * context * kv_token_bytes / plain_us / 1e3, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefix", type=int, default=1536)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if args.prefix >= args.context or args.prefix % BLOCK:
        parser.error(f"--prefix must be a multiple of {BLOCK} below --context")
    rows = [measure(seqs, args.context, args.prefix) for seqs in args.seqs]
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
