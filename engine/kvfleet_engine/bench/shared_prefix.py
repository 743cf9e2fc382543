"""Decode attention over a shared prefix against reading it per sequence, on the GPU: one
layer of an 8B model's decode attention (32 query heads, 8 kv heads, head_dim 128; a bf16 cache,
or with --fp8 an e4m3 one laid out as the engine allocates it), every sequence `--context`
tokens of which the first `--prefix` are the same cache blocks; each variant's output checked
against the other, then timed from a CUDA graph.

With --mixed N the step also holds a prompt chunk: one more sequence of the same length sharing
the same prefix, whose last N tokens are this step's queries. Timed: the prefill kernel over the
whole batch (the decode rows as one-token sequences), against the prefill kernel over the chunk
beside the decode kernel over the decode rows, per sequence and over the shared prefix; and the
engine's own mixed step (the prefill kernel leaving the decodes apart, then the decode kernels
at their rows), with --prefix-splits its prefix kernel's splits forced too.

  python -m kvfleet_engine.bench.shared_prefix --seqs 16 64 256 --context 2048 --prefix 1536 \\
      [--fp8] [--mixed 512] [--splits 1 2] [--prefix-splits 4 8] --output results.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from kvfleet_engine.bench.gemv import capture_graph, graph_seconds
from kvfleet_engine.kernels import paged_decode_attention, prefill_attention
from kvfleet_engine.kernels.checks import to_token_major
from kvfleet_engine.layers.attention_torch import quantize_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def case(seqs: int, context: int, prefix: int, fp8: bool, device: str = "cuda") -> dict:
    """The tensors of one problem: shared blocks first in every table, the rest each its own
    (`seqs` rows; a prompt chunk's sequence is one more made the same way)."""
    blocks = -(-context // BLOCK)
    shared = prefix // BLOCK
    own = blocks - shared
    total = shared + seqs * own
    gen = torch.Generator(device=device).manual_seed(0)
    cache_shape = (total, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device=device, dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(cache_shape, device=device, dtype=torch.bfloat16, generator=gen)
    rows = [[*range(shared), *range(shared + s * own, shared + (s + 1) * own)] for s in range(seqs)]
    block_tables = torch.tensor(rows, dtype=torch.int32, device=device)
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
        "query": torch.randn(seqs, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "context_lens": torch.full((seqs,), context, dtype=torch.int32, device=device),
        "shared_prefix": described.to(device),
        "scales": scales,
    }


def measure(
    seqs: int, context: int, prefix: int, fp8: bool, splits: list[int], prefix_splits: list[int]
) -> dict:
    tensors = case(seqs, context, prefix, fp8)
    shared, scales = tensors.pop("shared_prefix"), tensors.pop("scales")
    args = (*tensors.values(), HEAD_DIM**-0.5)

    def plain() -> torch.Tensor:
        return paged_decode_attention(*args, **scales)

    def with_prefix(
        num_splits: int | None = None, prefix_splits: int | None = None
    ) -> Callable[[], torch.Tensor]:
        return lambda: paged_decode_attention(
            *args, **scales, shared_prefix=shared, num_splits=num_splits,
            prefix_splits=prefix_splits,
        )  # fmt: skip

    want, got = plain().float(), with_prefix()().float()
    error = float((got - want).norm() / want.norm())
    plain_us, shared_us = _microseconds(plain), _microseconds(with_prefix())
    # The split kernel's splits over each sequence's own tokens, forced (the heuristic's above)
    by_splits = {str(n): round(_microseconds(with_prefix(n)), 1) for n in splits}
    # The prefix kernel's splits forced, each with its kernels' times
    by_prefix_splits = {
        str(n): {
            "step_us": round(_microseconds(with_prefix(prefix_splits=n)), 1),
            "kernels_us": kernel_us(with_prefix(prefix_splits=n)),
        }
        for n in prefix_splits
    }
    # What the sequences' own tokens cost alone: the same rows without the prefix (no sharing)
    own = case(seqs, context - prefix, 0, fp8)
    own.pop("shared_prefix")
    own_scales = own.pop("scales")
    own_args = (*own.values(), HEAD_DIM**-0.5)
    own_us = _microseconds(lambda: paged_decode_attention(*own_args, **own_scales))
    kernels = kernel_us(with_prefix())  # where the shared-prefix step's time goes
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
        "shared_prefix_us_by_splits": by_splits,
        "shared_prefix_by_prefix_splits": by_prefix_splits,
        "own_tokens_alone_us": round(own_us, 1),
        "shared_prefix_kernels_us": kernels,
        "own_tokens_gb_s": round(seqs * (context - prefix) * kv_token_bytes / own_us / 1e3, 1),
        "per_sequence_gb_s": round(seqs * context * kv_token_bytes / plain_us / 1e3, 1),
    }


def measure_mixed(
    seqs: int,
    context: int,
    prefix: int,
    fp8: bool,
    chunk: int,
    prefix_splits: list[int],
    device: str = "cuda",
) -> dict:
    """A step of `seqs` decode rows and one prompt chunk of `chunk` queries (the last row)."""
    tensors = case(seqs + 1, context, prefix, fp8, device)
    shared, scales = tensors.pop("shared_prefix"), tensors.pop("scales")
    shared[2 + seqs] = 0  # the chunk is the prefill kernel's
    k_cache, v_cache, tables, lens = (
        tensors[name] for name in ("k_cache", "v_cache", "block_tables", "context_lens")
    )
    cache = (k_cache, v_cache)
    dtype = torch.float32 if k_cache.dtype == torch.float32 else torch.bfloat16  # CPU checks
    query = torch.randn(seqs + chunk, HEADS, HEAD_DIM, device=device, dtype=dtype)
    cu = torch.tensor([*range(seqs + 1), seqs + chunk], dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5
    chunk_cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)

    def one_kernel() -> torch.Tensor:
        return prefill_attention(query, *cache, tables, cu, lens, scale, **scales)

    def chunk_alone() -> torch.Tensor:
        chunk_rows = (query[seqs:], *cache, tables[seqs:], chunk_cu, lens[seqs:], scale)
        return prefill_attention(*chunk_rows, **scales)

    def split(prefix_once: bool) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The decode kernel over the decode rows, then the prefill kernel over the chunk."""
        described = shared[: 2 + seqs] if prefix_once else None
        decode_rows = (query[:seqs], *cache, tables[:seqs], lens[:seqs], scale)
        return lambda: (
            paged_decode_attention(*decode_rows, **scales, shared_prefix=described),
            chunk_alone(),
        )

    def engine_step(forced: int | None = None) -> Callable[[], torch.Tensor]:
        """As the engine runs a mixed step: the prefill kernel over every row, leaving the
        decodes apart, then the decode kernels over those at their rows (`cu_query_lens`), over
        the shared prefix (its splits fixed for mixed steps unless `forced`)."""
        rows = (query, *cache, tables)

        def step() -> torch.Tensor:
            out = prefill_attention(*rows, cu, lens, scale, **scales, decodes_apart=True)
            return paged_decode_attention(
                *rows, lens, scale, **scales, shared_prefix=shared, cu_query_lens=cu, out=out,
                prefix_splits=forced,
            )  # fmt: skip

        return step

    want = one_kernel().float()
    errors = [
        float((torch.cat(split(s)()).float() - want).norm() / want.norm()) for s in (False, True)
    ]
    errors.append(float((engine_step()().float() - want).norm() / want.norm()))
    times = [_microseconds(f) for f in (one_kernel, split(False), split(True), chunk_alone)]
    engine_us = _microseconds(engine_step())
    by_prefix_splits = {str(n): round(_microseconds(engine_step(n)), 1) for n in prefix_splits}
    return {
        "cache": "fp8" if fp8 else "bf16",
        "decode_seqs": seqs,
        "chunk": chunk,
        "context": context,
        "prefix": prefix,
        "relative_error": max(errors),
        "prefill_kernel_us": round(times[0], 1),
        "split_per_sequence_us": round(times[1], 1),
        "split_shared_prefix_us": round(times[2], 1),
        "speedup": round(times[0] / times[2], 2),
        "chunk_alone_us": round(times[3], 1),
        "engine_mixed_step_us": round(engine_us, 1),
        "engine_mixed_step_us_by_prefix_splits": by_prefix_splits,
    }


def kernel_us(step: Callable[[], object], calls: int = 10) -> dict[str, float]:
    """Each kernel's GPU time in one call of `step`, by name (torch.profiler over one replay of a
    graph of `calls` calls; kernels on a side stream overlap the others, so these may add up
    to more than the call's time)."""
    graph = capture_graph(lambda: [step() for _ in range(calls)])
    cuda = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[cuda]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return {
        event.key[:48]: round(event.self_device_time_total / calls, 1)
        for event in prof.key_averages()
        if event.device_type == torch.autograd.DeviceType.CUDA
    }


def _microseconds(step: Callable[[], object]) -> float:
    def call() -> None:
        step()

    return graph_seconds(call) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefix", type=int, default=1536)
    parser.add_argument("--fp8", action="store_true", help="an e4m3 cache (kv_cache_dtype=fp8)")
    parser.add_argument(
        "--mixed",
        type=int,
        default=0,
        metavar="N",
        help="add a prompt chunk of N queries to every step (above)",
    )
    parser.add_argument(
        "--splits",
        type=int,
        nargs="*",
        default=[],
        help="also time the shared-prefix step with the split kernel's splits forced to each",
    )
    parser.add_argument(
        "--prefix-splits",
        type=int,
        nargs="*",
        default=[],
        help="also time the step (and its kernels) with the prefix kernel's splits forced",
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if args.prefix >= args.context or args.prefix % BLOCK:
        parser.error(f"--prefix must be a multiple of {BLOCK} below --context")
    for flag, values in (("--splits", args.splits), ("--prefix-splits", args.prefix_splits)):
        if any(n < 1 for n in values):
            parser.error(f"{flag} takes splits of 1 or more, got {values}")
    if args.mixed:
        problem = (args.context, args.prefix, args.fp8, args.mixed, args.prefix_splits)
        mixed = [measure_mixed(seqs, *problem) for seqs in args.seqs]
        print(
            f"{'decode seqs':>11} {'prefill kernel us':>18} {'split us':>9} {'shared us':>10}"
            f" {'chunk alone us':>15} {'engine us':>10}  engine us by prefix splits"
        )
        for row in mixed:
            print(
                f"{row['decode_seqs']:>11} {row['prefill_kernel_us']:>18} "
                f"{row['split_per_sequence_us']:>9} {row['split_shared_prefix_us']:>10}"
                f" {row['chunk_alone_us']:>15} {row['engine_mixed_step_us']:>10}"
                f"  {row['engine_mixed_step_us_by_prefix_splits']}"
            )
        if args.output:
            args.output.write_text(json.dumps({"rows": mixed}, indent=1) + "\n")
        return 0
    forced = (args.splits, args.prefix_splits)
    rows = [measure(seqs, args.context, args.prefix, args.fp8, *forced) for seqs in args.seqs]
    print(
        f"{'seqs':>5} {'per sequence us':>16} {'shared us':>10} {'speedup':>8} {'rel err':>9}"
        f" {'own tokens alone us':>20}  shared us by splits"
    )
    for row in rows:
        print(
            f"{row['seqs']:>5} {row['per_sequence_us']:>16} {row['shared_prefix_us']:>10} "
            f"{row['speedup']:>8} {row['relative_error']:>9.2e} "
            f"{row['own_tokens_alone_us']:>20}  {row['shared_prefix_us_by_splits']}"
        )
        print(f"      the shared-prefix step's kernels, us: {row['shared_prefix_kernels_us']}")
        for n, forced in row["shared_prefix_by_prefix_splits"].items():
            print(f"      {n} prefix splits: {forced['step_us']} us, {forced['kernels_us']}")
    if args.output:
        args.output.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
