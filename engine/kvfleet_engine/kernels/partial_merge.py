"""Merging the partial outputs of split-K decode attention by their log-sum-exps (log2 domain).

Each split of a sequence's context (`decode_kernels`), and each split of a shared prefix
(`shared_prefix`), leaves a partial output and its log-sum-exp in a slot of the partial
buffers, [num_seqs, num_q_heads, slots, head_dim] and [num_seqs, num_q_heads, slots] float32.
`merge_partials` launches `decode_merge_kernel`, one program per (sequence, query head) over
every slot; with a single split over a shared prefix the split kernel merges the prefix's slots
in its own epilogue instead (`merged_with_slots`). Either way an empty part (-inf) weighs
nothing, and a row with no part at all (padding in a captured batch) gets zeros, not NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import next_power_of_2
from kvfleet_engine.kernels.pdl import _start


@triton.jit
def group_rows_of(x, GROUP_PAD: tl.constexpr, GROUP_ROWS: tl.constexpr):
    """The first GROUP_ROWS rows of x [GROUP_PAD, n], as a tensor of them: Triton has no
    slices, so the rows are summed over the blocks of GROUP_ROWS, all but the first as zeros."""
    x = tl.reshape(x, [GROUP_PAD // GROUP_ROWS, GROUP_ROWS, x.shape[1]])
    blocks = tl.arange(0, GROUP_PAD // GROUP_ROWS)
    return tl.sum(tl.where(blocks[:, None, None] == 0, x, 0.0), axis=0)


@triton.jit
def merged_with_slots(
    out,
    lse,
    partial_out_ptr,
    partial_lse_ptr,
    first_slot_rows,
    dims,
    row_mask,
    dim_mask,
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    FIRST: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """`out` ([GROUP_PAD, BLOCK_D], log-sum-exp `lse`, log2 domain, -inf for none) merged with
    the partials in slots FIRST .. SLOTS - 1 of its first GROUP_ROWS rows (`first_slot_rows`:
    each such row's slot 0; `row_mask`, the group's), weighed as `decode_merge_kernel` weighs
    them: those rows, zeros where every part is empty. `dims`: the element order of `out`'s
    columns. On the group's rows alone (4 of the tile's 16 for an 8B model), and unrolled:
    every slot's loads go out together, where a loop over the whole tile's rows had each wait
    for the one before (or kept 16 registers a thread a slot)."""
    out = group_rows_of(out, GROUP_PAD, GROUP_ROWS)
    lse = tl.reshape(group_rows_of(lse[:, None], GROUP_PAD, GROUP_ROWS), [GROUP_ROWS])
    top = tl.maximum(lse, -1e30)
    for slot in tl.static_range(FIRST, SLOTS):
        lse_s = tl.load(partial_lse_ptr + first_slot_rows + slot, mask=row_mask, other=-1e30)
        top = tl.maximum(top, lse_s)
    own = tl.exp2(lse - top)  # 0 for an empty part
    total = own
    out = out * own[:, None]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    for slot in tl.static_range(FIRST, SLOTS):
        rows = first_slot_rows + slot
        weight = tl.exp2(tl.load(partial_lse_ptr + rows, mask=row_mask, other=float("-inf")) - top)
        out_s = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=out_mask)
        total += weight
        out += tl.where(weight[:, None] > 0, out_s * weight[:, None], 0.0)
    return out / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def decode_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    cu_query_lens_ptr,  # MIXED only (as the split kernel's)
    stride_os,
    stride_oh,
    num_q_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # the slots
    SPLITS_PAD: tl.constexpr,
    MIXED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    _start(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    out_row = seq
    mine = True
    if MIXED:
        out_row = tl.load(cu_query_lens_ptr + seq)
        mine = tl.load(cu_query_lens_ptr + seq + 1) - out_row == 1
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
        out_ptr + out_row * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=(dims < HEAD_DIM) & mine,
    )


def merge_partials(
    partial_out: torch.Tensor,  # [num_seqs, num_q_heads, slots, head_dim] float32
    partial_lse: torch.Tensor,  # [num_seqs, num_q_heads, slots] float32, log2 domain
    out: torch.Tensor,  # [rows, num_q_heads, head_dim]: each sequence's row written
    cu_query_lens: torch.Tensor | None,  # a mixed step's: only one-token sequences, at their row
    pdl_options: dict,  # the launch options (`pdl`)
) -> None:
    num_seqs, num_q_heads, slots, head_dim = partial_out.shape
    decode_merge_kernel[(num_seqs, num_q_heads)](
        partial_out,
        partial_lse,
        out,
        cu_query_lens if cu_query_lens is not None else partial_lse,  # never read without
        out.stride(0),
        out.stride(1),
        num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        NUM_SPLITS=slots,
        SPLITS_PAD=next_power_of_2(slots),
        MIXED=cu_query_lens is not None,
        **pdl_options,
    )
