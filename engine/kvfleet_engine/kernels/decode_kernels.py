"""The Triton kernels of paged decode attention (split-K, "flash-decoding"); their launch plan
and wrappers are `decode_attention`, which says what each program owns.

`decode_split_kernel`: one program per (sequence, kv head, split) walks its share of the context
with an online softmax (rotating the query and storing the new key and value first in the ROTARY
variant; in the CASCADE variant only the context after the batch's shared prefix, which
`shared_prefix` attends to; in the MIXED variant, a step with prompt tokens, only its one-token
sequences, each query at its token's row). `partial_merge` merges the splits by their
log-sum-exp, or with one split over a shared prefix the split kernel merges the prefix kernel's
partials itself (MERGE_PREFIX, `partial_merge.merged_with_slots`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet_engine.kernels.attention_tile import attend_range, fp8_scales_ahead, whole_end
from kvfleet_engine.kernels.kv_fp8 import (
    f16_rows,
    quantize_rows,
    v_scale_boost,
)
from kvfleet_engine.kernels.partial_merge import merged_with_slots
from kvfleet_engine.kernels.pdl import _late_wait, _start


@triton.jit
def rotated(x_ptr, dims, mask, cos_sin_row, HALF: tl.constexpr):
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
def decode_split_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    shared_prefix_ptr,  # CASCADE only: [2 + num_seqs] int32, what is shared (`shared_prefix`)
    cu_query_lens_ptr,  # MIXED only: [num_seqs + 1] int32, each sequence's first token row
    partial_out_ptr,  # [num_seqs, num_q_heads, SLOTS, HEAD_DIM] float32
    partial_lse_ptr,  # [num_seqs, num_q_heads, SLOTS] float32, log2 domain
    out_ptr,  # [rows, num_q_heads, HEAD_DIM]: written here instead when SLOTS == 1
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
    stride_cvb,  # the V cache's own strides: its rows (K's layout) or token major (`checks`)
    stride_cvs,
    stride_cvh,
    stride_cvd,
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
    GROUP_PAD: tl.constexpr,  # the tile's rows: at least 16 (tl.dot)
    GROUP_ROWS: tl.constexpr,  # the group's power of two (MERGE_PREFIX's epilogue rows)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLOTS: tl.constexpr,  # NUM_SPLITS, and under CASCADE the prefix kernel's splits after them
    CASCADE: tl.constexpr,
    # CASCADE with one split, the prefix kernel run before on this stream: its partials merged
    # here into the output (no partial of this program's own, no merge kernel)
    MERGE_PREFIX: tl.constexpr,
    MIXED: tl.constexpr,  # query and output rows are tokens; other sequences are left alone
    ROTARY: tl.constexpr,
    FP8: tl.constexpr,
    F16_DOTS: tl.constexpr,
    TRANSPOSE_SCORES: tl.constexpr,
    EARLY_V: tl.constexpr,
    V_ROWS: tl.constexpr,  # V in K's layout (else token major: `kv_fp8.v_tile`)
    V_RUN: tl.constexpr,
    PREFETCH_SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,  # one-warp programs (`attention_tile.attend_tile`)
    PDL: tl.constexpr = False,
    # MERGE_PREFIX launched while the prefix kernel runs: only its partials wait for it (`pdl`)
    LATE_WAIT: tl.constexpr = False,
):
    _start(PDL, LATE_WAIT)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    row = seq  # of the query and the output
    mine = True
    if MIXED:  # a sequence with more (or no) query tokens is the prefill kernel's: reads nothing
        row = tl.load(cu_query_lens_ptr + seq)
        mine = tl.load(cu_query_lens_ptr + seq + 1) - row == 1
        context_len = tl.where(mine, context_len, 0)
    shared = 0
    if CASCADE:  # a shared prefix is the prefix kernel's (whole blocks, shorter than a sharer's
        # context; padding rows, context 0, read nothing whatever stale share they hold)
        shared = tl.multiple_of(tl.load(shared_prefix_ptr + 2 + seq), BLOCK_SIZE)
        if MIXED:
            shared = tl.where(mine, shared, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(context_len - shared, BLOCK_N), NUM_SPLITS)
    start = shared + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q_rows = query_ptr + row * stride_qs + heads[:, None] * stride_qh + dims[None, :]
    q_mask = row_mask[:, None] & dim_mask[None, :]
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_offset = kv_head * stride_ch + dims[None, :]
    v_offset = kv_head * stride_cvh + dims[None, :] * stride_cvd
    if ROTARY:
        # Rotate this group's query heads in registers; the split holding the newest position
        # rotates the new key and stores it and the value in the cache before reading it back.
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq) * stride_rot
        q = rotated(q_rows, dims[None, :], q_mask, cos_sin_row, HEAD_DIM // 2)
        slot = tl.load(slot_mapping_ptr + seq)
        store = (start < end) & (end == context_len) & (slot >= 0)
        new_mask = dim_mask[None, :] & store
        k_row = key_ptr + seq * stride_ks + kv_head * stride_kh + dims[None, :]
        k_new = rotated(k_row, dims[None, :], new_mask, cos_sin_row, HEAD_DIM // 2)
        v_new = tl.load(
            value_ptr + seq * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=new_mask,
            other=0.0,
        )
        slot = tl.maximum(slot, 0)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        dst = block * stride_cb + offset * stride_cs + kv_offset
        v_dst = block * stride_cvb + offset * stride_cvs + v_offset
        if FP8:
            k_new, k_new_scale = quantize_rows(k_new, k_cache_ptr.dtype.element_ty)  # [1, BLOCK_D]
            v_new, v_new_scale = quantize_rows(v_new, v_cache_ptr.dtype.element_ty)
            scale_dst = block * stride_sb + kv_head * stride_sh + offset + tl.arange(0, 1)
            tl.store(k_scales_ptr + scale_dst, k_new_scale, mask=store)
            tl.store(v_scales_ptr + scale_dst, v_new_scale, mask=store)
        tl.store(k_cache_ptr + dst, k_new, mask=new_mask)
        tl.store(v_cache_ptr + v_dst, v_new, mask=new_mask)
        tl.debug_barrier()  # the stores above are visible to this program's loads below
    else:
        q = tl.load(q_rows, mask=q_mask, other=0.0)
    q_dot = q
    q_t = q
    row_scale = tl.full([GROUP_PAD], 1.0, tl.float32) * scale_log2
    prefetched = (row_scale, row_scale, rows)  # never read without an fp8 cache
    if FP8:
        if F16_DOTS:  # 16-bit queries: e4m3 converts to float16 in one instruction per pair
            q_dot, q_factor = f16_rows(q)
            row_scale = q_factor * scale_log2
        if TRANSPOSE_SCORES:
            q_t = tl.trans(q_dot)  # [BLOCK_D, GROUP_PAD]
        prefetched = fp8_scales_ahead(
            k_scales_ptr, v_scales_ptr, block_table, start, end, kv_head, stride_sb, stride_sh,
            BLOCK_N, BLOCK_SIZE, PREFETCH_SCALES,
        )  # fmt: skip

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    state = (m_i, l_i, acc, prefetched)
    # Whole tiles, then at most one partial tile (`attention_tile`: only that one needs masks).
    state = attend_range(
        state, q_dot, q_t, row_scale, row_scale, k_cache_ptr, v_cache_ptr, k_scales_ptr,
        v_scales_ptr, block_table, start, whole_end(start, end, BLOCK_N), end, kv_offset, kv_head,
        dims, dim_mask, stride_cb, stride_cs, stride_cvb, stride_cvh, stride_cvd, stride_sb,
        stride_sh, BLOCK_N, BLOCK_SIZE, FP8, EARLY_V, V_ROWS, V_RUN, PREFETCH_SCALES,
        DOT_PRECISION, TRANSPOSE_SCORES, False, LAZY_RESCALE,
    )  # fmt: skip
    m_i, l_i, acc = state[0], state[1], state[2]

    if FP8:
        acc = acc * (1.0 / v_scale_boost(v_cache_ptr.dtype.element_ty))
        if EARLY_V:
            dims = dims ^ 1
    nonempty = l_i > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    out_mask = row_mask[:, None] & dim_mask[None, :]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    if MERGE_PREFIX:  # the whole context: the output (zeros for an empty sequence)
        group_rows = tl.arange(0, GROUP_ROWS)
        group_heads = kv_head * GROUP + group_rows
        _late_wait(LATE_WAIT)
        out = merged_with_slots(
            out, lse, partial_out_ptr, partial_lse_ptr, (seq * num_q_heads + group_heads) * SLOTS,
            dims, group_rows < GROUP, dim_mask, HEAD_DIM, GROUP_PAD, GROUP_ROWS, NUM_SPLITS, SLOTS,
        )  # fmt: skip
        out_rows = out_ptr + row * stride_os + group_heads[:, None] * stride_oh + dims[None, :]
        group_mask = (group_rows < GROUP)[:, None] & dim_mask[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=group_mask & mine)
    elif SLOTS == 1:  # the whole context: the output (zeros for an empty sequence)
        out_rows = out_ptr + row * stride_os + heads[:, None] * stride_oh
        tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask & mine)
    else:
        partial_row = (seq * num_q_heads + heads) * SLOTS + split
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_mask)
        partial_rows = partial_out_ptr + partial_row[:, None] * HEAD_DIM
        tl.store(partial_rows + dims[None, :], out, mask=out_mask)
