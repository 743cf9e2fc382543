"""Paged decode attention, split-K ("flash-decoding"): one new query token per sequence.

Each program owns (sequence, kv head, split): it loads the query heads that share the kv head as
the rows of one tile, so every K/V tile is read once per group, and walks its share of the context
with an online softmax. A second kernel merges the splits by their log-sum-exp
(`partial_merge`); with a single split (large batches) the first kernel writes the output itself
and the merge is skipped. The grid depends only on tensor shapes (context lengths are read on the
device), so the launch can be captured in a CUDA graph and replayed with new lengths.

`rotary_decode_attention` is the same kernel taking the step's q, k and v before rotary: each
program rotates its query heads in registers, and the split holding the newest position rotates
the new key and stores it and the value in the cache before reading the context.

An fp8 cache (`kv_fp8`) is read as e4m3 tiles converted to float16 for tl.dot (16-bit queries),
each score column multiplied by its key's scale and each softmax weight by its value's scale.

`shared_prefix`: sequences of the batch share their first cache blocks, and
`kernels.shared_prefix` (which says what the tensor holds) attends to those once per tile of
query rows; the split kernel reads each sharer's context after them, and the merge combines both.

`cu_query_lens`: a step with prompt tokens (`prefill_attention`'s batch, which leaves its
one-token sequences to these kernels with `decodes_apart`): `query` holds every token, and each
sequence with exactly one query token is attended as a decode row, its query and output at its
token's row of `query` and `out`; the others' rows are not touched. Split across the context
(and its shared prefix read once), such rows cost a fraction of what the prefill kernel's tiles,
one program per sequence and 16 query rows wide, spend on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet_engine.kernels import shared_prefix as prefix_kernel
from kvfleet_engine.kernels.checks import (
    LOG2E,
    check_index,
    check_paged_attention,
    check_rotary_store,
    dot_precision,
    next_power_of_2,
    num_sms,
    require,
)
from kvfleet_engine.kernels.decode_kernels import decode_split_kernel
from kvfleet_engine.kernels.decode_plan import SHORT_FP8_TILE, plan_decode
from kvfleet_engine.kernels.partial_merge import merge_partials
from kvfleet_engine.kernels.pdl import launch_options, pair_options
from kvfleet_engine.layers.attention_torch import KVCache


@dataclass(frozen=True)
class _NewToken:
    """What the ROTARY variant reads besides the query: the step's key and value rows (before
    rotary), positions, cos | sin table and cache slots."""

    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass(frozen=True)
class _Rows:
    """Where the queries are and where the outputs go: a decode step's row per sequence and a
    new output (None, None), or a mixed step's token rows (`cu_query_lens`) and, if given, the
    output to write them into."""

    cu_query_lens: torch.Tensor | None
    out: torch.Tensor | None


@dataclass(frozen=True)
class _Launch:
    num_splits: int | None  # None: choose_num_splits
    block_n: int | None  # context tokens per tile (None: the cache's default tiles)
    num_warps: int | None
    num_stages: int
    # fp8 cache only (kv_fp8): scores as K @ q^T (K the first tl.dot operand) instead of q @ K^T;
    # V converted to float16 before its trip through shared memory (`swapped_pairs`; a V cache
    # in K's row layout only: a token-major one goes through shared memory as codes, as K does);
    # the next tile's scales loaded during this one (`prefetched_scales`; None: except over
    # 16-token tiles, where loading them where used measured faster, `decode_plan`).
    transpose_scores: bool
    early_v: bool
    prefetch_scales: bool | None
    # ptxas's register cap per thread (None: its own choice); fewer registers, more programs per SM
    max_registers: int | None = None
    # rescale the accumulator only when a row's max grew (None: for one-warp programs, where
    # the test is one warp's; `attention_tile.attend_tile`)
    lazy_rescale: bool | None = None
    # the prefix kernel's splits over a shared prefix (None: `choose_prefix_splits`)
    prefix_splits: int | None = None


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: fp8 cache
    v_scales: torch.Tensor | None = None,
    shared_prefix: torch.Tensor | None = None,  # [2 + num_seqs] int32 (`shared_prefix`)
    cu_query_lens: torch.Tensor | None = None,  # [num_seqs + 1] int32: a mixed step (above)
    out: torch.Tensor | None = None,  # written in place (a mixed step: the prefill's output)
    num_splits: int | None = None,  # override the heuristic (benchmarks)
    prefix_splits: int | None = None,  # the prefix kernel's, likewise
    block_n: int | None = None,  # context tokens per tile (None: the cache's default tiles)
    num_warps: int | None = None,
    num_stages: int = 2,
    transpose_scores: bool = False,  # fp8 cache: see _Launch
    early_v: bool = True,
    prefetch_scales: bool | None = None,
    max_registers: int | None = None,
    lazy_rescale: bool | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim] (a mixed step: [num_tokens, ...])
    check_paged_attention(query, k_cache, v_cache, block_tables, context_lens, k_scales, v_scales)
    for name, splits in (("num_splits", num_splits), ("prefix_splits", prefix_splits)):
        require(splits is None or splits >= 1, f"{name} must be 1 or more, got {splits}")
    tiles = (num_splits, block_n, num_warps, num_stages)
    launch = _Launch(
        *tiles, transpose_scores, early_v, prefetch_scales, max_registers, lazy_rescale,
        prefix_splits,
    )  # fmt: skip
    cache = (k_cache, v_cache, k_scales, v_scales)
    rows = _Rows(cu_query_lens, out)
    return _decode(
        query, cache, block_tables, context_lens, scale, None, launch, shared_prefix, rows
    )


def rotary_decode_attention(
    positions: torch.Tensor,  # [num_seqs] int64
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], before rotary (left as it is)
    key: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim], before rotary (left as it is)
    value: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim]
    cos_sin: torch.Tensor,  # [max_positions, head_dim] float32: cos | sin halves
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_seqs] int64; -1 skips the store
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: fp8 cache
    v_scales: torch.Tensor | None = None,
    shared_prefix: torch.Tensor | None = None,  # [2 + num_seqs] int32 (`shared_prefix`)
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    transpose_scores: bool = False,
    early_v: bool = True,
    prefetch_scales: bool | None = None,
    max_registers: int | None = None,
    lazy_rescale: bool | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """A decode step's whole attention in one launch: rotary on q and k, the store of the new k
    and v in the cache (`rotary_store_kv`), then `paged_decode_attention` — at batch 1 each of
    those is a few microseconds of launch latency, and the query makes one trip to memory."""
    check_paged_attention(query, k_cache, v_cache, block_tables, context_lens, k_scales, v_scales)
    check_rotary_store(positions, query, key, value, cos_sin, k_cache, slot_mapping)
    new = _NewToken(key, value, positions, cos_sin, slot_mapping)
    tiles = (num_splits, block_n, num_warps, num_stages)
    launch = _Launch(
        *tiles, transpose_scores, early_v, prefetch_scales, max_registers, lazy_rescale
    )
    cache = (k_cache, v_cache, k_scales, v_scales)
    rows = _Rows(None, None)
    return _decode(
        query, cache, block_tables, context_lens, scale, new, launch, shared_prefix, rows
    )


def _decode(
    query: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    new: _NewToken | None,
    launch: _Launch,
    shared_prefix: torch.Tensor | None,
    rows: _Rows,
) -> torch.Tensor:
    k_cache, v_cache, k_scales, v_scales = cache
    mixed = rows.cu_query_lens
    num_seqs = context_lens.shape[0]
    if mixed is None:
        require(num_seqs == query.shape[0], "context_lens must have one entry per query row")
    else:
        check_index(mixed, "cu_query_lens", 1, torch.int32, k_cache.device)
        require(mixed.shape[0] == num_seqs + 1, "cu_query_lens must have num_seqs + 1 entries")
        require(new is None, "a mixed step's tokens are rotated and stored before attention")
    if shared_prefix is not None:
        check_index(shared_prefix, "shared_prefix", 1, torch.int32, k_cache.device)
        require(
            shared_prefix.shape[0] >= 2 + num_seqs,
            "shared_prefix must be [2 + num_seqs]: tokens, holder row, then tokens per sequence",
        )
    _, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = rows.out
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    else:
        require(out.shape == query.shape, "out must have the query's shape")
    if num_seqs == 0:
        return out
    v_rows = v_cache.stride() == k_cache.stride()  # else token major (`checks.check_cache`)
    forced = (launch.block_n, launch.num_warps, launch.num_splits, launch.prefix_splits)
    group = num_q_heads // num_kv_heads
    plan = plan_decode(
        num_seqs, num_kv_heads, group, block_tables.shape[1] * block_size,
        num_sms(query.device), token_major_fp8=k_scales is not None and not v_rows,
        fp8_codes=k_cache.dtype == torch.float8_e4m3fn, mixed=mixed is not None,
        shared_prefix=shared_prefix is not None, forced=forced, registers=launch.max_registers,
    )  # fmt: skip
    if mixed is not None and shared_prefix is None:  # 0 tokens: the same variant as with one
        shared_prefix = torch.zeros(2 + num_seqs, dtype=torch.int32, device=query.device)
    slots = plan.slots
    partial_out = torch.empty(
        (num_seqs, num_q_heads, slots, head_dim), dtype=torch.float32, device=query.device
    )
    partial_lse = torch.empty(
        (num_seqs, num_q_heads, slots), dtype=torch.float32, device=query.device
    )
    # Without the new token, its pointers are the query's and its strides 0: never read.
    rotary = new if new is not None else _NewToken(query, query, query, query, query)
    join_prefix = None
    # One split: the prefix kernel first, and the split kernel merges its partials (no merge
    # kernel), launched with PDL where available so that it walks its own context while the
    # prefix kernel runs and waits only to merge (`pdl`). Beside the split kernel on a second
    # stream the two did not overlap (an H100, bench/NOTES.md section 31); with more splits the
    # merge kernel stays, and the prefix kernel goes there.
    merge_prefix = plan.merge_prefix
    if shared_prefix is not None:
        join_prefix = prefix_kernel.launch(
            query, cache, block_tables, context_lens, shared_prefix, (partial_out, partial_lse),
            (new.positions, new.cos_sin) if new is not None else None, scale, plan.num_splits,
            plan.prefix_splits, mixed, beside=not merge_prefix,
        )  # fmt: skip
    split_options = launch_options(query.device)
    if merge_prefix:  # the pair that overlaps by PDL where it is available (`pdl`)
        split_options = pair_options(query.device)
        split_options["LATE_WAIT"] = split_options["PDL"]
    decode_split_kernel[(num_seqs, num_kv_heads, plan.num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        shared_prefix if shared_prefix is not None else context_lens,  # never read without
        mixed if mixed is not None else context_lens,  # never read without
        partial_out,
        partial_lse,
        out,
        rotary.key,
        rotary.value,
        rotary.positions,
        rotary.cos_sin,
        rotary.slot_mapping,
        k_scales if k_scales is not None else k_cache,  # a float cache: never read
        v_scales if v_scales is not None else v_cache,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        block_tables.stride(0),
        rotary.key.stride(0) if new is not None else 0,
        rotary.key.stride(1) if new is not None else 0,
        rotary.value.stride(0) if new is not None else 0,
        rotary.value.stride(1) if new is not None else 0,
        rotary.cos_sin.stride(0) if new is not None else 0,
        k_scales.stride(0) if k_scales is not None else 0,
        k_scales.stride(1) if k_scales is not None else 0,
        num_q_heads,
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        GROUP_ROWS=next_power_of_2(group),
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_N=plan.block_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=plan.num_splits,
        SLOTS=slots,
        CASCADE=shared_prefix is not None,
        MERGE_PREFIX=merge_prefix,
        MIXED=mixed is not None,
        ROTARY=new is not None,
        FP8=k_scales is not None,
        F16_DOTS=query.dtype in (torch.float16, torch.bfloat16),
        TRANSPOSE_SCORES=launch.transpose_scores,
        EARLY_V=launch.early_v and v_rows,
        V_ROWS=v_rows,
        V_RUN=min(plan.block_n, block_size),
        PREFETCH_SCALES=(
            plan.block_n != SHORT_FP8_TILE
            if launch.prefetch_scales is None
            else launch.prefetch_scales
        ),
        DOT_PRECISION=dot_precision(query.dtype),
        LAZY_RESCALE=plan.num_warps == 1 if launch.lazy_rescale is None else launch.lazy_rescale,
        num_warps=plan.num_warps,
        num_stages=launch.num_stages,
        maxnreg=launch.max_registers,
        **split_options,
    )
    if join_prefix is not None:
        join_prefix()
    if slots == 1 or merge_prefix:
        return out
    # after the prefix kernel's stream joined: a whole dependency, not PDL's early start
    pdl_options = launch_options(query.device) if join_prefix is None else {"PDL": False}
    merge_partials(partial_out, partial_lse, out, mixed, pdl_options)
    return out
