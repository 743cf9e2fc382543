"""Paged prefill/extend attention: query tokens of several sequences, packed back to back, attend
causally to their sequence's cached prefix and to each other, all read through the block table.

Each program owns one tile of query rows (BLOCK_Q tokens × the query heads of one kv head, so K/V
are loaded once per group) and walks the context from position 0 up to its last row's position
with an online softmax. Programs find their sequence from `cu_query_lens` on the device, so the
launch needs no host-side maximum query length. An fp8 cache is read as the decode kernel reads
it (`decode_attention`, `kv_fp8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.attention_tile import attend_range, fp8_scales_ahead
from kvfleet_engine.kernels.checks import (
    LOG2E,
    check_index,
    check_paged_attention,
    dot_precision,
    next_power_of_2,
    require,
)
from kvfleet_engine.kernels.kv_fp8 import f16_rows, v_scale_boost


# Values that change from step to step are not specialised on (that would recompile mid-run).
@triton.jit(do_not_specialize=("num_seqs", "stride_bt"))
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    cu_query_lens_ptr,
    context_lens_ptr,
    k_scales_ptr,  # FP8 only: [num_blocks, num_kv_heads, block_size] bfloat16
    v_scales_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cvb,  # the V cache's own strides: its rows (K's layout) or token major (`checks`)
    stride_cvs,
    stride_cvh,
    stride_cvd,
    stride_bt,
    stride_sb,
    stride_sh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    F16_DOTS: tl.constexpr,
    EARLY_V: tl.constexpr,
    V_ROWS: tl.constexpr,  # V in K's layout (else token major: `kv_fp8.v_tile`)
    V_RUN: tl.constexpr,
    PREFETCH_SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DECODES_APART: tl.constexpr,  # one-token sequences are the decode kernel's: skipped
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Sequence s owns tiles [cu_query_lens[s] // BLOCK_Q + s, cu_query_lens[s+1] // BLOCK_Q + s+1):
    # enough for its query length, so the grid needs only num_tokens // BLOCK_Q + num_seqs.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_query_lens_ptr + mid) // BLOCK_Q + mid <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    query_start = tl.load(cu_query_lens_ptr + seq)
    query_len = tl.load(cu_query_lens_ptr + seq + 1) - query_start
    first_token = (tile_id - (query_start // BLOCK_Q + seq)) * BLOCK_Q
    attends = first_token < query_len
    if DECODES_APART:
        attends = attends & (query_len > 1)
    if attends:
        context_len = tl.load(context_lens_ptr + seq)
        prefix_len = context_len - query_len
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        tokens = first_token + rows // GROUP_PAD
        heads = kv_head * GROUP + rows % GROUP_PAD
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        row_mask = (tokens < query_len) & (rows % GROUP_PAD < GROUP)
        io_mask = row_mask[:, None] & dim_mask[None, :]
        token_ids = (query_start + tokens).to(tl.int64)
        q = tl.load(
            query_ptr + token_ids[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=io_mask,
            other=0.0,
        )
        row_positions = prefix_len + tokens
        end = tl.minimum(context_len, prefix_len + first_token + BLOCK_Q)
        block_table = block_tables_ptr + seq * stride_bt
        kv_offset = kv_head * stride_ch + dims[None, :]

        if FP8:
            if F16_DOTS:  # 16-bit queries: float16 dots (`decode_attention`)
                q, q_factor = f16_rows(q)
                row_scale = q_factor * scale_log2
            else:
                row_scale = tl.full([BLOCK_Q * GROUP_PAD], 1.0, tl.float32) * scale_log2

        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], dtype=tl.float32)
        if not FP8:
            row_scale = tl.full([BLOCK_Q * GROUP_PAD], 1.0, tl.float32) * scale_log2
        prefetched = fp8_scales_ahead(
            k_scales_ptr, v_scales_ptr, block_table, 0, end, kv_head, stride_sb, stride_sh,
            BLOCK_N, BLOCK_SIZE, FP8 and PREFETCH_SCALES,
        )  # fmt: skip
        state = (m_i, l_i, acc, prefetched)
        # Tiles that end at or before the first row's own position are seen whole by every row:
        # no causal mask, nor the end's (WHOLE: they end before it). Tile 0 holds position 0,
        # visible to every row, so m_i is finite from the first tile on.
        unmasked_end = (prefix_len + first_token + 1) // BLOCK_N * BLOCK_N
        state = attend_range(
            state, q, q, row_scale, row_positions, k_cache_ptr, v_cache_ptr, k_scales_ptr,
            v_scales_ptr, block_table, 0, unmasked_end, end, kv_offset, kv_head, dims, dim_mask,
            stride_cb, stride_cs, stride_cvb, stride_cvh, stride_cvd, stride_sb, stride_sh,
            BLOCK_N, BLOCK_SIZE, FP8, EARLY_V, V_ROWS, V_RUN, PREFETCH_SCALES, DOT_PRECISION,
            False, True,
        )  # fmt: skip
        m_i, l_i, acc = state[0], state[1], state[2]

        if FP8:
            acc = acc * (1.0 / v_scale_boost(v_cache_ptr.dtype.element_ty))
            if EARLY_V:
                dims = dims ^ 1  # V's columns were swapped in pairs
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + token_ids[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], sequences back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_query_lens: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32 = cached prefix + this step's query tokens
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: fp8 cache
    v_scales: torch.Tensor | None = None,
    block_m: int = 64,  # query rows (tokens × heads of one group) per program
    block_n: int = 64,  # context tokens per tile
    num_warps: int = 4,
    num_stages: int = 2,
    # fp8 cache only: float16 dots for 16-bit queries (else dots in the query dtype), and V
    # converted before shared memory (`decode_attention`'s early_v). Chosen apart from decode's:
    # the prefill kernel is bound by its tensor-core work, not by loads.
    f16_dots: bool = True,
    early_v: bool = False,
    prefetch_scales: bool = True,  # the next tile's scales loaded during this one
    # Leave sequences of one query token to `paged_decode_attention(cu_query_lens=...)`, which
    # then writes their rows of the output returned here (left unwritten by this kernel).
    decodes_apart: bool = False,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    check_paged_attention(query, k_cache, v_cache, block_tables, context_lens, k_scales, v_scales)
    check_index(cu_query_lens, "cu_query_lens", 1, torch.int32, k_cache.device)
    num_seqs = context_lens.shape[0]
    require(cu_query_lens.shape[0] == num_seqs + 1, "cu_query_lens must have num_seqs + 1 entries")
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_q = max(1, block_m // group_pad)
    if block_q * group_pad < 16:  # tl.dot needs at least 16 rows
        block_q = 16 // group_pad
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    v_rows = v_cache.stride() == k_cache.stride()  # else token major (`checks.check_cache`)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_query_lens,
        context_lens,
        k_scales if k_scales is not None else k_cache,  # a float cache: never read
        v_scales if v_scales is not None else v_cache,
        scale * LOG2E,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        block_tables.stride(0),
        k_scales.stride(0) if k_scales is not None else 0,
        k_scales.stride(1) if k_scales is not None else 0,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        FP8=k_scales is not None,
        F16_DOTS=f16_dots and query.dtype in (torch.float16, torch.bfloat16),
        EARLY_V=early_v and v_rows,
        V_ROWS=v_rows,
        V_RUN=min(block_n, block_size),
        PREFETCH_SCALES=prefetch_scales,
        DOT_PRECISION=dot_precision(query.dtype),
        DECODES_APART=decodes_apart,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
