"""One context tile of the attention kernels (decode, shared prefix, prefill): `attend_tile`
folds a tile into the online softmax of a program's query rows — its K and V read through the
block table (`kv_tile`), the scores (log2 domain, -inf where masked), the running row max and sum
(`softmax_tile`) and P · V (for an fp8 cache, `fp8_pv`: V scaled per token, rows past the context
zeroed, and with EARLY_V converted in swapped pairs before shared memory: `kv_fp8`).

WHOLE tiles lie entirely before the end of the context a program reads: their positions need no
mask, so every mask of the tile is a constant the compiler folds away. The kernels walk their
context as whole tiles first and at most one partial tile last. On an fp8 cache's one-warp decode
programs the masks were a fifth of the tile loop (sm_90: ~250 of 1,263 instructions, mostly the
per-token select that zeroes V's rows past the context, on pairs of float16 tokens taken apart
and put back together)."""

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
    WHOLE: tl.constexpr,
):  # fmt: skip
    """(positions [BLOCK_N], valid = before `end`, their block ids, K [BLOCK_N, BLOCK_D], V) of
    the tile of context positions from tile_start, through one sequence's block table (`kv_offset`:
    the kv head's and dims' offset in K's row layout; V in its own, `kv_fp8.v_tile`). WHOLE: the
    caller knows the tile ends at or before `end`; `valid` is then a constant true."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    if WHOLE:
        valid = tl.full([BLOCK_N], 1, tl.int1)
        used = valid
    else:
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
def attend_tile(
    state, q, q_t, row_scale, row_positions, k_cache_ptr, v_cache_ptr, k_scales_ptr,
    v_scales_ptr, block_table, tile_start, end, kv_offset, kv_head, dims, dim_mask, stride_cb,
    stride_cs, stride_cvb, stride_cvh, stride_cvd, stride_sb, stride_sh,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, EARLY_V: tl.constexpr,
    V_ROWS: tl.constexpr, V_RUN: tl.constexpr, PREFETCH_SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TRANSPOSE_SCORES: tl.constexpr, CAUSAL: tl.constexpr,
    WHOLE: tl.constexpr, LAZY_RESCALE: tl.constexpr = False,
):  # fmt: skip
    """One context tile into the online softmax of the query rows q: `state` is (row max, row
    sum, accumulator, and for an fp8 cache with PREFETCH_SCALES what `fp8_tile_scales` carries to
    the next tile); the new state is returned. row_scale [rows]: what turns q · k into a log2
    score (for an fp8 cache also undoing q's own scaling, `kv_fp8.f16_rows`). fp8 only:
    TRANSPOSE_SCORES computes them as K @ q_t (q_t = q transposed; else unused). CAUSAL masks each
    row to the positions up to its own (row_positions [rows]; else unused); WHOLE: the tile ends
    at or before `end` (no mask there). LAZY_RESCALE (one-warp programs, where the test is a
    warp's own): the accumulator is rescaled only when a row's max grew — past the first tiles it
    rarely does, and otherwise every factor is exactly 1 (the same result, without a multiply
    per accumulator element)."""
    m_i, l_i, acc, prefetched = state
    positions, valid, block_ids, k, v = kv_tile(
        k_cache_ptr, v_cache_ptr, block_table, tile_start, end, kv_offset, kv_head, dims,
        dim_mask, stride_cb, stride_cs, stride_cvb, stride_cvh, stride_cvd, BLOCK_N, BLOCK_SIZE,
        V_ROWS, V_RUN, WHOLE,
    )  # fmt: skip
    if FP8:
        k_scale, v_scale, prefetched = fp8_tile_scales(
            prefetched, k_scales_ptr, v_scales_ptr, block_table, block_ids, positions, valid,
            tile_start, end, kv_head, stride_sb, stride_sh, BLOCK_N, BLOCK_SIZE, PREFETCH_SCALES,
        )  # fmt: skip
        k = k.to(q.dtype)
        if TRANSPOSE_SCORES:  # K as the first operand: [BLOCK_N, rows]
            scores = tl.trans(tl.dot(k, q_t, input_precision=DOT_PRECISION))
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        scores = scores * row_scale[:, None] * k_scale[None, :]
    else:
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * row_scale[:, None]
    if CAUSAL:
        visible = valid[None, :] & (positions[None, :] <= row_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
    else:
        scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new, alpha, p, l_i = softmax_tile(scores, m_i, l_i)
    if FP8:
        pv = fp8_pv(p, v, v_scale, valid, q, V_ROWS, EARLY_V, DOT_PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    if LAZY_RESCALE:
        if tl.max((m_new > m_i).to(tl.int32), axis=0) > 0:
            acc = acc * alpha[:, None]
        acc = acc + pv
    else:
        acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc, prefetched


@triton.jit
def attend_range(
    state, q, q_t, row_scale, row_positions, k_cache_ptr, v_cache_ptr, k_scales_ptr,
    v_scales_ptr, block_table, start, split, end, kv_offset, kv_head, dims, dim_mask, stride_cb,
    stride_cs, stride_cvb, stride_cvh, stride_cvd, stride_sb, stride_sh,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, EARLY_V: tl.constexpr,
    V_ROWS: tl.constexpr, V_RUN: tl.constexpr, PREFETCH_SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TRANSPOSE_SCORES: tl.constexpr, CAUSAL: tl.constexpr,
    LAZY_RESCALE: tl.constexpr = False,
):  # fmt: skip
    """The context [start, end) into the online softmax (`attend_tile`, whose arguments these
    are): the tiles before `split` whole, with no mask (the caller knows they end at or before
    `end` and that every row sees them all), then the rest with the end's mask and, with CAUSAL,
    each row's own (decode: split = `whole_end(start, end)`)."""
    for tile_start in range(start, split, BLOCK_N):
        state = attend_tile(
            state, q, q_t, row_scale, row_positions, k_cache_ptr, v_cache_ptr, k_scales_ptr,
            v_scales_ptr, block_table, tile_start, end, kv_offset, kv_head, dims, dim_mask,
            stride_cb, stride_cs, stride_cvb, stride_cvh, stride_cvd, stride_sb, stride_sh,
            BLOCK_N, BLOCK_SIZE, FP8, EARLY_V, V_ROWS, V_RUN, PREFETCH_SCALES, DOT_PRECISION,
            TRANSPOSE_SCORES, False, True, LAZY_RESCALE,
        )  # fmt: skip
    for tile_start in range(split, end, BLOCK_N):
        state = attend_tile(
            state, q, q_t, row_scale, row_positions, k_cache_ptr, v_cache_ptr, k_scales_ptr,
            v_scales_ptr, block_table, tile_start, end, kv_offset, kv_head, dims, dim_mask,
            stride_cb, stride_cs, stride_cvb, stride_cvh, stride_cvd, stride_sb, stride_sh,
            BLOCK_N, BLOCK_SIZE, FP8, EARLY_V, V_ROWS, V_RUN, PREFETCH_SCALES, DOT_PRECISION,
            TRANSPOSE_SCORES, CAUSAL, False, LAZY_RESCALE,
        )  # fmt: skip
    return state


@triton.jit
def whole_end(start, end, BLOCK_N: tl.constexpr):
    """Where the whole tiles from `start` stop: the rest of [start, end) is at most one partial
    tile (none when end <= start)."""
    return start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N


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
