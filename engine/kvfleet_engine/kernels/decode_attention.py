"""Paged decode attention, split-K ("flash-decoding"): one new query token per sequence.

Each program owns (sequence, kv head, split): it loads the query heads that share the kv head as
the rows of one tile, so every K/V tile is read once per group, and walks its share of the context
with an online softmax. A second kernel merges the splits by their log-sum-exp; with a single
split (large batches) the first kernel writes the output itself and the merge is skipped. The grid
depends only on tensor shapes (context lengths are read on the device), so the launch can be
captured in a CUDA graph and replayed with new lengths.

`rotary_decode_attention` is the same kernel taking the step's q, k and v before rotary: each
program rotates its query heads in registers, and the split holding the newest position rotates
the new key and stores it and the value in the cache before reading the context.

An fp8 cache (`kv_fp8`) is read as e4m3 tiles converted to float16 for tl.dot (16-bit queries),
each score column multiplied by its key's scale and each softmax weight by its value's scale.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import (
    LOG2E,
    check_paged_attention,
    check_rotary_store,
    dot_precision,
    next_power_of_2,
    require,
)
from kvfleet_engine.kernels.kv_fp8 import (
    V_SCALE_BOOST,
    f16_rows,
    prefetched_scales,
    quantize_rows,
    swapped_pairs,
    tile_block_ids,
    tile_scales,
)
from kvfleet_engine.layers.attention_torch import KVCache


@triton.jit
def _rotated(x_ptr, dims, mask, cos_sin_row, HALF: tl.constexpr):
    """Rotate-half rotary of the head rows at x_ptr ([rows, BLOCK_D] pointers to each element;
    `dims` are their [1, BLOCK_D] indices), in float32, rounded back to the input dtype as the
    in-place rotary kernels round."""
    partner_shift = tl.where(dims < HALF, HALF, -HALF)
    freq = tl.where(dims < HALF, dims, dims - HALF)
    x = tl.load(x_ptr, mask=mask, other=0.0)
    partner = tl.load(x_ptr + partner_shift, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_sin_row + freq, mask=dims < 2 * HALF, other=0.0)
    sin = tl.load(cos_sin_row + HALF + freq, mask=dims < 2 * HALF, other=0.0)
    xf = x.to(tl.float32)
    out = tl.where(dims < HALF, xf * cos - partner * sin, xf * cos + partner * sin)
    return out.to(x.dtype)


# Values that change from step to step are not specialised on (that would recompile mid-run).
@triton.jit(do_not_specialize=("stride_bt",))
def _decode_split_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    partial_out_ptr,  # [num_seqs, num_q_heads, NUM_SPLITS, HEAD_DIM] float32
    partial_lse_ptr,  # [num_seqs, num_q_heads, NUM_SPLITS] float32, log2 domain
    out_ptr,  # [num_seqs, num_q_heads, HEAD_DIM]: written here instead when NUM_SPLITS == 1
    # ROTARY only: this step's key and value rows, positions, cos | sin table and cache slots.
    key_ptr,
    value_ptr,
    positions_ptr,
    cos_sin_ptr,
    slot_mapping_ptr,
    # FP8 only: the cache's scales, [num_blocks, num_kv_heads, block_size] bfloat16 each.
    k_scales_ptr,
    v_scales_ptr,
    scale_log2,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rot,
    stride_sb,
    stride_sh,
    num_q_heads,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ROTARY: tl.constexpr,
    FP8: tl.constexpr,
    F16_DOTS: tl.constexpr,
    TRANSPOSE_SCORES: tl.constexpr,
    EARLY_V: tl.constexpr,
    PREFETCH_SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(context_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q_rows = query_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :]
    q_mask = row_mask[:, None] & dim_mask[None, :]
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_offset = kv_head * stride_ch + dims[None, :]
    if ROTARY:
        # Rotate this group's query heads in registers; the split holding the newest position
        # rotates the new key and stores it and the value in the cache before reading it back.
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq) * stride_rot
        q = _rotated(q_rows, dims[None, :], q_mask, cos_sin_row, HEAD_DIM // 2)
        slot = tl.load(slot_mapping_ptr + seq)
        store = (start < end) & (end == context_len) & (slot >= 0)
        new_mask = dim_mask[None, :] & store
        k_row = key_ptr + seq * stride_ks + kv_head * stride_kh + dims[None, :]
        k_new = _rotated(k_row, dims[None, :], new_mask, cos_sin_row, HEAD_DIM // 2)
        v_new = tl.load(
            value_ptr + seq * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=new_mask,
            other=0.0,
        )
        slot = tl.maximum(slot, 0)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        dst = block * stride_cb + offset * stride_cs + kv_offset
        if FP8:
            k_new, k_new_scale = quantize_rows(k_new)  # [1, BLOCK_D] codes, [1] scale
            v_new, v_new_scale = quantize_rows(v_new)
            scale_dst = block * stride_sb + kv_head * stride_sh + offset + tl.arange(0, 1)
            tl.store(k_scales_ptr + scale_dst, k_new_scale, mask=store)
            tl.store(v_scales_ptr + scale_dst, v_new_scale, mask=store)
        tl.store(k_cache_ptr + dst, k_new, mask=new_mask)
        tl.store(v_cache_ptr + dst, v_new, mask=new_mask)
        tl.debug_barrier()  # the stores above are visible to this program's loads below
    else:
        q = tl.load(q_rows, mask=q_mask, other=0.0)
    if FP8:
        if F16_DOTS:  # 16-bit queries: e4m3 converts to float16 in one instruction per pair
            q_dot, q_factor = f16_rows(q)
            row_scale = q_factor * scale_log2
        else:
            q_dot = q
            row_scale = tl.full([GROUP_PAD], 1.0, tl.float32) * scale_log2
        if TRANSPOSE_SCORES:
            q_dot_t = tl.trans(q_dot)  # [BLOCK_D, GROUP_PAD]
        if PREFETCH_SCALES:  # the first tile's scales, the second's block ids (`kv_fp8`)
            first = start + tl.arange(0, BLOCK_N)
            ids_first = tile_block_ids(block_table, start, end, BLOCK_N, BLOCK_SIZE)
            k_scale_next = tile_scales(
                k_scales_ptr, ids_first, kv_head, first, first < end, stride_sb, stride_sh,
                BLOCK_SIZE,
            )  # fmt: skip
            v_scale_next = tile_scales(
                v_scales_ptr, ids_first, kv_head, first, first < end, stride_sb, stride_sh,
                BLOCK_SIZE,
            )  # fmt: skip
            ids_next = tile_block_ids(block_table, start + BLOCK_N, end, BLOCK_N, BLOCK_SIZE)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = positions < end
        block_ids = tl.load(block_table + positions // BLOCK_SIZE, mask=valid, other=0)
        rows_off = block_ids.to(tl.int64) * stride_cb + (positions % BLOCK_SIZE) * stride_cs
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + rows_off[:, None] + kv_offset, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows_off[:, None] + kv_offset, mask=kv_mask, other=0.0)
        if FP8:
            if PREFETCH_SCALES:
                k_scale, v_scale = k_scale_next, v_scale_next
                k_scale_next, v_scale_next, ids_next = prefetched_scales(
                    k_scales_ptr, v_scales_ptr, block_table, ids_next, tile_start, end, kv_head,
                    stride_sb, stride_sh, BLOCK_N, BLOCK_SIZE,
                )  # fmt: skip
            else:
                k_scale = tile_scales(
                    k_scales_ptr, block_ids, kv_head, positions, valid, stride_sb, stride_sh,
                    BLOCK_SIZE,
                )  # fmt: skip
                v_scale = tile_scales(
                    v_scales_ptr, block_ids, kv_head, positions, valid, stride_sb, stride_sh,
                    BLOCK_SIZE,
                )  # fmt: skip
            k = k.to(q_dot.dtype)
            if TRANSPOSE_SCORES:  # K as the first operand: [BLOCK_N, GROUP_PAD]
                scores = tl.trans(tl.dot(k, q_dot_t, input_precision=DOT_PRECISION))
            else:
                scores = tl.dot(q_dot, tl.trans(k), input_precision=DOT_PRECISION)
            scores = scores * row_scale[:, None] * k_scale[None, :]
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8:
            weighted = (p * (v_scale * V_SCALE_BOOST)[None, :]).to(q_dot.dtype)
            v = v.to(q_dot.dtype)
            if EARLY_V:  # columns swapped in pairs (undone at the store): see swapped_pairs
                v = swapped_pairs(v)
            pv = tl.dot(weighted, v, input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if FP8:
        acc = acc * (1.0 / V_SCALE_BOOST)
        if EARLY_V:
            dims = dims ^ 1
    nonempty = l_i > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:  # the whole context: this is the output (zeros for an empty sequence)
        out_rows = out_ptr + seq * stride_os + heads[:, None] * stride_oh
        tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        partial_row = (seq * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_mask)
        partial_rows = partial_out_ptr + partial_row[:, None] * HEAD_DIM
        tl.store(partial_rows + dims[None, :], out, mask=out_mask)


@triton.jit
def _decode_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    num_q_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    row = (seq * num_q_heads + head) * NUM_SPLITS + splits
    lse = tl.load(partial_lse_ptr + row, mask=splits < NUM_SPLITS, other=float("-inf"))
    # A sequence with no context at all (padding in a captured batch) gets zeros, not NaN.
    lse_max = tl.maximum(tl.max(lse, axis=0), -1e30)
    weights = tl.exp2(lse - lse_max)
    parts = tl.load(
        partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=(splits < NUM_SPLITS)[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weights, axis=0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int
) -> int:
    """Enough (sequence, kv head, split) programs for about two waves over the SMs, never more
    splits than the longest possible context has tiles. Depends on shapes only."""
    wanted = -(-2 * num_sms // max(num_seqs * num_kv_heads, 1))
    max_tiles = max(-(-max_context // block_n), 1)
    return max(1, min(wanted, max_tiles, 64))


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
class _Launch:
    num_splits: int | None  # None: choose_num_splits
    block_n: int  # context tokens per tile
    num_warps: int
    num_stages: int
    # fp8 cache only (kv_fp8): scores as K @ q^T (K the first tl.dot operand) instead of q @ K^T;
    # V converted to float16 before its trip through shared memory (`swapped_pairs`); the next
    # tile's scales loaded during this one (`prefetched_scales`).
    transpose_scores: bool
    early_v: bool
    prefetch_scales: bool


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
    num_splits: int | None = None,  # override the heuristic (benchmarks)
    block_n: int = 64,  # context tokens per tile
    num_warps: int = 4,
    num_stages: int = 2,
    transpose_scores: bool = False,  # fp8 cache: see _Launch
    early_v: bool = True,
    prefetch_scales: bool = True,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    check_paged_attention(query, k_cache, v_cache, block_tables, context_lens, k_scales, v_scales)
    launch = _Launch(
        num_splits, block_n, num_warps, num_stages, transpose_scores, early_v, prefetch_scales
    )
    cache = (k_cache, v_cache, k_scales, v_scales)
    return _decode(query, cache, block_tables, context_lens, scale, None, launch)


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
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    transpose_scores: bool = False,
    early_v: bool = True,
    prefetch_scales: bool = True,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """A decode step's whole attention in one launch: rotary on q and k, the store of the new k
    and v in the cache (`rotary_store_kv`), then `paged_decode_attention` — at batch 1 each of
    those is a few microseconds of launch latency, and the query makes one trip to memory."""
    check_paged_attention(query, k_cache, v_cache, block_tables, context_lens, k_scales, v_scales)
    check_rotary_store(positions, query, key, value, cos_sin, k_cache, slot_mapping)
    new = _NewToken(key, value, positions, cos_sin, slot_mapping)
    launch = _Launch(
        num_splits, block_n, num_warps, num_stages, transpose_scores, early_v, prefetch_scales
    )
    cache = (k_cache, v_cache, k_scales, v_scales)
    return _decode(query, cache, block_tables, context_lens, scale, new, launch)


def _decode(
    query: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    new: _NewToken | None,
    launch: _Launch,
) -> torch.Tensor:
    k_cache, v_cache, k_scales, v_scales = cache
    require(
        context_lens.shape[0] == query.shape[0], "context_lens must have one entry per query row"
    )
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    num_splits = launch.num_splits
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_context, launch.block_n, _num_sms(query.device)
        )
    partial_out = torch.empty(
        (num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    partial_lse = torch.empty(
        (num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=query.device
    )
    block_d = next_power_of_2(head_dim)
    # Without the new token, its pointers are the query's and its strides 0: never read.
    rotary = new if new is not None else _NewToken(query, query, query, query, query)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
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
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=launch.block_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        ROTARY=new is not None,
        FP8=k_scales is not None,
        F16_DOTS=query.dtype in (torch.float16, torch.bfloat16),
        TRANSPOSE_SCORES=launch.transpose_scores,
        EARLY_V=launch.early_v,
        PREFETCH_SCALES=launch.prefetch_scales,
        DOT_PRECISION=dot_precision(query.dtype),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if num_splits == 1:
        return out
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        partial_out,
        partial_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=next_power_of_2(num_splits),
    )
    return out
