"""One context tile of the attention kernels (decode, shared prefix, prefill): its K and V read
through the block table, the online softmax's running row max and sum updated by its scores
(log2 domain, -inf where masked), and its P · V when the cache is fp8 (V scaled per token, rows
past the context zeroed, and with EARLY_V converted in swapped pairs before shared memory:
`kv_fp8`)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet_engine.kernels.kv_fp8 import (
    prefetched_scales,
    swapped_pairs,
    tile_block_ids,
    tile_scales,
    v_rows_valid,
    v_scale_boost,
    v_tile,
)


@triton.jit
def kv_tile(
    k_cache_ptr, v_cache_ptr, block_table, tile_start, end, kv_offset, kv_head, dims, dim_mask,
    stride_cb, stride_cs, stride_cvb, stride_cvh, stride_cvd,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, V_ROWS: tl.constexpr, V_RUN: tl.constexpr,
):  # fmt: skip
    """(positions [BLOCK_N], valid = before `end`, their block ids, K [BLOCK_N, BLOCK_D], V) of
    the tile of context positions from tile_start, through one sequence's block table (`kv_offset`:
    the kv head's and dims' offset in K's row layout; V in its own, `kv_fp8.v_tile`)."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    valid = positions < end
    used = (positions // BLOCK_SIZE) * BLOCK_SIZE < end  # blocks holding context
    block_ids = tl.load(block_table + positions // BLOCK_SIZE, mask=used, other=0)
    rows_off = block_ids.to(tl.int64) * stride_cb + (positions % BLOCK_SIZE) * stride_cs
    kv_mask = valid[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + rows_off[:, None] + kv_offset, mask=kv_mask, other=0.0)
    v_offsets, v_mask = v_tile(
        block_ids, positions, used, rows_off, kv_offset, kv_mask, kv_head, dims, dim_mask,
        stride_cvb, stride_cvh, stride_cvd, V_ROWS, V_RUN, BLOCK_SIZE,
    )  # fmt: skip
    v = tl.load(v_cache_ptr + v_offsets, mask=v_mask, other=0.0)
    return positions, valid, block_ids, k, v


@triton.jit
def kv_tile_scales(
    k_scales_ptr, v_scales_ptr, block_ids, kv_head, positions, valid, stride_sb, stride_sh,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """An fp8 tile's K and V scales [BLOCK_N] (float32), loaded where used (`kv_tile`'s block ids
    and positions)."""
    k_scale = tile_scales(
        k_scales_ptr, block_ids, kv_head, positions, valid, stride_sb, stride_sh, BLOCK_SIZE
    )
    v_scale = tile_scales(
        v_scales_ptr, block_ids, kv_head, positions, valid, stride_sb, stride_sh, BLOCK_SIZE
    )
    return k_scale, v_scale


@triton.jit
def fp8_scales_ahead(
    k_scales_ptr, v_scales_ptr, block_table, start, end, kv_head, stride_sb, stride_sh,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PREFETCH_SCALES: tl.constexpr,
):  # fmt: skip
    """What `fp8_tile_scales` takes for the first tile, from `start`: with PREFETCH_SCALES its K
    and V scales and the second tile's block ids (`kv_fp8`), else zeros it never reads."""
    if PREFETCH_SCALES:
        first = start + tl.arange(0, BLOCK_N)
        ids_first = tile_block_ids(block_table, start, end, BLOCK_N, BLOCK_SIZE)
        k_first = tile_scales(
            k_scales_ptr, ids_first, kv_head, first, first < end, stride_sb, stride_sh, BLOCK_SIZE
        )
        v_first = tile_scales(
            v_scales_ptr, ids_first, kv_head, first, first < end, stride_sb, stride_sh, BLOCK_SIZE
        )
        ids_second = tile_block_ids(block_table, start + BLOCK_N, end, BLOCK_N, BLOCK_SIZE)
    else:
        k_first = tl.zeros([BLOCK_N], dtype=tl.float32)
        v_first = k_first
        ids_second = tl.zeros([BLOCK_N], dtype=tl.int32)
    return k_first, v_first, ids_second


@triton.jit
def fp8_tile_scales(
    prefetched, k_scales_ptr, v_scales_ptr, block_table, block_ids, positions, valid, tile_start,
    end, kv_head, stride_sb, stride_sh,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PREFETCH_SCALES: tl.constexpr,
):  # fmt: skip
    """(K scales, V scales, what the next tile takes) of an fp8 tile: with PREFETCH_SCALES its
    scales were loaded a tile ahead (`prefetched`: this tile's K and V scales and the next tile's
    block ids) and the next tile's are loaded now (`kv_fp8.prefetched_scales`); else they are
    loaded where used and `prefetched` passes through untouched."""
    k_next, v_next, ids_next = prefetched
    if PREFETCH_SCALES:
        k_scale, v_scale = k_next, v_next
        k_next, v_next, ids_next = prefetched_scales(
            k_scales_ptr, v_scales_ptr, block_table, ids_next, tile_start, end, kv_head,
            stride_sb, stride_sh, BLOCK_N, BLOCK_SIZE,
        )  # fmt: skip
    else:
        k_scale, v_scale = kv_tile_scales(
            k_scales_ptr, v_scales_ptr, block_ids, kv_head, positions, valid, stride_sb,
            stride_sh, BLOCK_SIZE,
        )  # fmt: skip
    return k_scale, v_scale, (k_next, v_next, ids_next)


@triton.jit
def softmax_tile(scores, m_i, l_i):
    """(new row max, the factor that rescales what came before, P, new row sum) of a tile."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def fp8_pv(
    p, v, v_scale, valid, dot_like,
    V_ROWS: tl.constexpr, EARLY_V: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """P · V of an fp8 tile in dot_like's dtype: the per-token V scales (boosted, undone after
    the loop) go into P."""
    weighted = (p * (v_scale * v_scale_boost(v.dtype))[None, :]).to(dot_like.dtype)
    v = v_rows_valid(v.to(dot_like.dtype), valid, V_ROWS)
    if EARLY_V:  # columns swapped in pairs (undone at the store): see swapped_pairs
        v = swapped_pairs(v)
    return tl.dot(weighted, v, input_precision=DOT_PRECISION)
