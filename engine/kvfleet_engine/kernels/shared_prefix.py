"""Decode attention over a prefix many sequences of the batch share ("cascade" attention).

When sequences of a decode step start with the same cache blocks (a system prompt or a few-shot
preamble, found by the prefix cache), the split kernel would read those blocks once per sequence.
This kernel reads them once per tile of query rows instead: each program owns (kv head, prefix
split, BLOCK_Q query rows of several sequences, each the query heads that share the kv head) and
attends the rows of the sequences that share the prefix to its share of it, read through one
sharer's block table. Its partial outputs and log-sum-exps go to slots of the split kernel's
partial buffer past that kernel's own (which then covers only each sharer's context after the
prefix), and the merge combines them all (`partial_merge`).

The step says which prefix in `shared_prefix`, int32 [2 + num_seqs]: the prefix's tokens (a
multiple of the block size), the row of a sequence that holds it, then per sequence the tokens
it shares (the prefix's, or 0). All of it is read on the device and the grid depends on shapes
only, so one CUDA graph serves every prefix and sharer set, none included.

`launch` launches it on a second stream (on a GPU), so that it may run while the split
kernel reads the rest, and the merge waits for both; or, before a split kernel of one split, on
the same stream with PDL where available, that kernel walking its own context while this one
runs and then merging the prefix's partials itself (`pdl`, `decode_attention`).
The ROTARY variant rotates the query rows in registers as `rotary_decode_attention` does (the
same function: the same rounding); the MIXED one serves a step with prompt tokens, whose
one-token sequences have their query at their token's row (`decode_attention`). An fp8 cache is
read as the split kernel reads it (`kv_fp8`: float16 dots, per-token K and V scales, either V
layout).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.attention_tile import attend_range, whole_end
from kvfleet_engine.kernels.checks import LOG2E, dot_precision, next_power_of_2
from kvfleet_engine.kernels.decode_kernels import rotated
from kvfleet_engine.kernels.decode_plan import PREFIX_BLOCK_N, PREFIX_BLOCK_Q
from kvfleet_engine.kernels.kv_fp8 import f16_rows, v_scale_boost
from kvfleet_engine.kernels.pdl import _start, launch_options, pair_options
from kvfleet_engine.layers.attention_torch import KVCache

# Tiles: `decode_plan.PREFIX_BLOCK_Q` and `PREFIX_BLOCK_N`; splits: `choose_prefix_splits` there.
NUM_WARPS = 4


# Values that change from step to step are not specialised on (that would recompile mid-run),
# nor the splits and slots, which change with the batch size: one compile serves every graph.
@triton.jit(do_not_specialize=("num_seqs", "stride_bt", "prefix_splits", "first_slot", "slots"))
def shared_prefix_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,  # the holder's row is read: the prefix's blocks
    context_lens_ptr,  # rows of sequences with no context (padding) get nothing
    shared_prefix_ptr,  # [2 + num_seqs] int32 (above)
    cu_query_lens_ptr,  # MIXED only: [num_seqs + 1] int32, each sequence's first token row
    partial_out_ptr,  # [num_seqs, num_q_heads, slots, HEAD_DIM] float32
    partial_lse_ptr,  # [num_seqs, num_q_heads, slots] float32, log2 domain
    positions_ptr,  # ROTARY only: each sequence's position and the cos | sin table
    cos_sin_ptr,
    k_scales_ptr,  # FP8 only: [num_blocks, num_kv_heads, block_size] bfloat16 each
    v_scales_ptr,
    scale_log2,
    num_seqs,
    stride_qs,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cvb,
    stride_cvs,
    stride_cvh,
    stride_cvd,
    stride_bt,
    stride_rot,
    stride_sb,
    stride_sh,
    num_q_heads,
    prefix_splits,
    first_slot,  # the split kernel's slots come first
    slots,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROTARY: tl.constexpr,
    MIXED: tl.constexpr,  # a step with prompt tokens: queries at their tokens' rows
    FP8: tl.constexpr,
    F16_DOTS: tl.constexpr,
    V_ROWS: tl.constexpr,  # V in K's layout (else token major: `kv_fp8.v_tile`)
    V_RUN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    _start(PDL)
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    q_tile = tl.program_id(2)
    prefix_len = tl.load(shared_prefix_ptr)
    holder = tl.load(shared_prefix_ptr + 1)
    tiles_per_split = tl.cdiv(tl.cdiv(prefix_len, BLOCK_N), prefix_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, prefix_len)

    rows = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (sequence, member of the group)
    seqs = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    in_batch = seqs < num_seqs
    active = in_batch & (tl.load(context_lens_ptr + seqs, mask=in_batch, other=0) > 0)
    active = active & (tl.load(shared_prefix_ptr + 2 + seqs, mask=in_batch, other=0) > 0)
    tokens = seqs
    if MIXED:  # only one-token sequences share (the runner's shares say so too)
        tokens = tl.load(cu_query_lens_ptr + seqs, mask=in_batch, other=0)
        ends = tl.load(cu_query_lens_ptr + seqs + 1, mask=in_batch, other=0)
        active = active & (ends - tokens == 1)
    q_rows = query_ptr + tokens[:, None] * stride_qs + heads[:, None] * stride_qh + dims[None, :]
    q_mask = active[:, None] & dim_mask[None, :]
    if ROTARY:
        position = tl.load(positions_ptr + seqs, mask=active, other=0)
        cos_sin_rows = cos_sin_ptr + position[:, None] * stride_rot
        q = rotated(q_rows, dims[None, :], q_mask, cos_sin_rows, HEAD_DIM // 2)
    else:
        q = tl.load(q_rows, mask=q_mask, other=0.0)
    kv_offset = kv_head * stride_ch + dims[None, :]
    q_dot = q
    row_scale = tl.full([BLOCK_Q], 1.0, tl.float32) * scale_log2
    if FP8 and F16_DOTS:  # 16-bit queries: e4m3 converts to float16 in one instruction per pair
        q_dot, q_factor = f16_rows(q)
        row_scale = q_factor * scale_log2

    block_table = block_tables_ptr + holder.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    state = (m_i, l_i, acc, (row_scale, row_scale, rows))  # no scales carried between tiles
    # Whole tiles, then at most one partial tile (`attention_tile`: only that one needs masks).
    state = attend_range(
        state, q_dot, q_dot, row_scale, row_scale, k_cache_ptr, v_cache_ptr, k_scales_ptr,
        v_scales_ptr, block_table, start, whole_end(start, end, BLOCK_N), end, kv_offset, kv_head,
        dims, dim_mask, stride_cb, stride_cs, stride_cvb, stride_cvh, stride_cvd, stride_sb,
        stride_sh, BLOCK_N, BLOCK_SIZE, FP8, False, V_ROWS, V_RUN, False, DOT_PRECISION, False,
        False,
    )  # fmt: skip
    m_i, l_i, acc = state[0], state[1], state[2]
    if FP8:
        acc = acc * (1.0 / v_scale_boost(v_cache_ptr.dtype.element_ty))

    nonempty = active & (l_i > 0)
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    partial_row = (seqs * num_q_heads + heads) * slots + first_slot + split
    tl.store(partial_lse_ptr + partial_row, lse, mask=in_batch)
    partial_rows = partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :]
    tl.store(partial_rows, out, mask=in_batch[:, None] & dim_mask[None, :])


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def launch(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim] ([num_tokens, ...] when mixed)
    cache: KVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    shared_prefix: torch.Tensor,  # [2 + num_seqs] int32 (above)
    partials: tuple[torch.Tensor, torch.Tensor],  # the split kernel's out and lse buffers
    rotary: tuple[torch.Tensor, torch.Tensor] | None,  # ROTARY: positions, cos | sin table
    scale: float,
    num_splits: int,  # the split kernel's slots, first in the partials
    prefix_splits: int,
    cu_query_lens: torch.Tensor | None = None,  # mixed steps: [num_seqs + 1], queries' rows
    *,
    beside: bool = True,
) -> Callable[[], None]:
    """Launch the prefix kernel after what the current stream has queued, on a second stream
    on a GPU (captured into a CUDA graph as a parallel branch); call the returned function
    after launching the split kernel: the current stream then waits for it. beside=False: on
    the current stream, with PDL where available (`pdl.pair_options`): a split kernel that
    merges its partials runs after it, walking its own context while this kernel runs."""
    k_cache, v_cache, k_scales, v_scales = cache
    _, num_q_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    partial_out, partial_lse = partials
    positions, cos_sin = rotary if rotary is not None else (query, query)  # never read without
    grid = (num_kv_heads, prefix_splits, -(-num_seqs * group // PREFIX_BLOCK_Q))
    main = side = None
    if beside and query.device.type == "cuda":
        main, side = torch.cuda.current_stream(query.device), _side_stream(query.device)
        side.wait_stream(main)
    with torch.cuda.stream(side):  # no-op for None (the CPU)
        shared_prefix_kernel[grid](
            query,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            shared_prefix,
            cu_query_lens if cu_query_lens is not None else context_lens,  # never read without
            partial_out,
            partial_lse,
            positions,
            cos_sin,
            k_scales if k_scales is not None else k_cache,  # a float cache: never read
            v_scales if v_scales is not None else v_cache,
            scale * LOG2E,
            num_seqs,
            query.stride(0),
            query.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            *v_cache.stride(),
            block_tables.stride(0),
            cos_sin.stride(0) if rotary is not None else 0,
            k_scales.stride(0) if k_scales is not None else 0,
            k_scales.stride(1) if k_scales is not None else 0,
            num_q_heads,
            prefix_splits,
            num_splits,
            num_splits + prefix_splits,
            GROUP=group,
            BLOCK_Q=PREFIX_BLOCK_Q,
            HEAD_DIM=head_dim,
            BLOCK_D=next_power_of_2(head_dim),
            BLOCK_N=PREFIX_BLOCK_N,
            BLOCK_SIZE=block_size,
            ROTARY=rotary is not None,
            MIXED=cu_query_lens is not None,
            FP8=k_scales is not None,
            F16_DOTS=query.dtype in (torch.float16, torch.bfloat16),
            V_ROWS=v_cache.stride() == k_cache.stride(),
            V_RUN=min(PREFIX_BLOCK_N, block_size),
            DOT_PRECISION=dot_precision(query.dtype),
            num_warps=NUM_WARPS,
            **(launch_options(query.device) if beside else pair_options(query.device)),
        )

    def join() -> None:
        if main is not None and side is not None:
            main.wait_stream(side)

    return join
