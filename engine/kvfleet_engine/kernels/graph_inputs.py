"""Fill a decode CUDA graph's persistent input buffers from the step's uploaded inputs in one
launch: token ids (a PENDING_TOKEN input taken from the previous step's samples on the device),
positions, cache slots, context lengths and block-table rows; padding rows up to the graph's
batch size get slot -1 and context 0, so they store nothing and attend to nothing.

One kernel instead of a chain of copies, fills and gathers: at batch 1 each of those costs a few
microseconds of device time between two graph replays, a few percent of a decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import require


@triton.jit(do_not_specialize=("num_rows", "width"))
def _decode_graph_inputs_kernel(
    ids_ptr,  # [num_rows] int64
    positions_ptr,  # [num_rows] int64
    slots_ptr,  # [num_rows] int64
    sources_ptr,  # [num_rows] int64: row of the previous samples, -1 = the id is known
    samples_ptr,  # [*] int64: the previous step's sampled tokens
    context_lens_ptr,  # [num_rows] int32
    block_tables_ptr,  # [num_rows, width] int32, contiguous
    out_ids_ptr,
    out_positions_ptr,
    out_slots_ptr,
    out_context_lens_ptr,
    out_block_tables_ptr,
    num_rows,
    width,
    stride_out_bt,
    HAS_PENDING: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    if row < num_rows:
        token = tl.load(ids_ptr + row)
        if HAS_PENDING:
            source = tl.load(sources_ptr + row)
            sampled = tl.load(samples_ptr + tl.maximum(source, 0))
            token = tl.where(source >= 0, sampled, token)
        tl.store(out_ids_ptr + row, token)
        tl.store(out_positions_ptr + row, tl.load(positions_ptr + row))
        tl.store(out_slots_ptr + row, tl.load(slots_ptr + row))
        tl.store(out_context_lens_ptr + row, tl.load(context_lens_ptr + row))
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            entries = tl.load(block_tables_ptr + row * width + cols, mask=cols < width)
            tl.store(out_block_tables_ptr + row * stride_out_bt + cols, entries, mask=cols < width)
    else:
        tl.store(out_slots_ptr + row, tl.full([], -1, tl.int64))
        tl.store(out_context_lens_ptr + row, tl.full([], 0, tl.int32))


def fill_decode_graph_inputs(
    input_ids: torch.Tensor,  # [n] int64
    positions: torch.Tensor,  # [n] int64
    slot_mapping: torch.Tensor,  # [n] int64
    context_lens: torch.Tensor,  # [n] int32
    block_tables: torch.Tensor,  # [n, width] int32, contiguous
    pending_sources: torch.Tensor | None,  # [n] int64 row in `samples`, -1 = known; or None
    samples: torch.Tensor | None,  # previous step's samples, int64 (needed with pending_sources)
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    size: int,  # rows to fill: n live ones, then padding
) -> None:
    """Write rows [0, size) of the graph buffers out = (ids, positions, slots, context lens,
    block tables [>= size, >= width])."""
    num_rows, width = block_tables.shape
    out_ids, out_positions, out_slots, out_context_lens, out_block_tables = out
    require(num_rows <= size <= out_ids.shape[0], "size must be in [rows, graph batch size]")
    require(width <= out_block_tables.shape[1], "block tables are wider than the graph's")
    require(block_tables.is_contiguous(), "block_tables must be contiguous")
    has_pending = pending_sources is not None
    if has_pending:
        require(samples is not None, "pending_sources needs the samples they index")
    _decode_graph_inputs_kernel[(size,)](
        input_ids,
        positions,
        slot_mapping,
        pending_sources if has_pending else input_ids,
        samples if has_pending else input_ids,
        context_lens,
        block_tables,
        out_ids,
        out_positions,
        out_slots,
        out_context_lens,
        out_block_tables,
        num_rows,
        width,
        out_block_tables.stride(0),
        HAS_PENDING=has_pending,
        BLOCK_W=64,
    )
