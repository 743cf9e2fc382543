"""Fill a CUDA graph's persistent input buffers from the step's uploaded inputs in one launch:
token ids (a PENDING_TOKEN input taken from the previous step's samples on the device),
positions and cache slots per token; context lengths, block-table rows and (for a prompt step's
graph) the query-length prefix sums per sequence. Padding tokens up to the graph's token count
get slot -1, so they store nothing; padding sequences up to its sequence count get context 0 and
no query tokens, so they attend to nothing and own no token.

One kernel instead of a chain of copies, fills and gathers: at batch 1 each of those costs a few
microseconds of device time between two graph replays, a few percent of a decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import require


@triton.jit(do_not_specialize=("num_tokens", "num_seqs", "tokens_pad", "seqs_pad", "width"))
def _graph_inputs_kernel(
    ids_ptr,  # [num_tokens] int64
    positions_ptr,  # [num_tokens] int64
    slots_ptr,  # [num_tokens] int64
    sources_ptr,  # [num_tokens] int64: row of the previous samples, -1 = the id is known
    samples_ptr,  # [*] int64: the previous step's sampled tokens
    context_lens_ptr,  # [num_seqs] int32
    cu_query_lens_ptr,  # [num_seqs + 1] int32 (HAS_CU only)
    block_tables_ptr,  # [num_seqs, width] int32, contiguous
    out_ids_ptr,
    out_positions_ptr,
    out_slots_ptr,
    out_context_lens_ptr,
    out_cu_query_lens_ptr,
    out_block_tables_ptr,
    num_tokens,
    num_seqs,
    tokens_pad,
    seqs_pad,
    width,
    stride_out_bt,
    HAS_PENDING: tl.constexpr,
    HAS_CU: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    if row < num_tokens:
        token = tl.load(ids_ptr + row)
        if HAS_PENDING:
            source = tl.load(sources_ptr + row)
            sampled = tl.load(samples_ptr + tl.maximum(source, 0))
            token = tl.where(source >= 0, sampled, token)
        tl.store(out_ids_ptr + row, token)
        tl.store(out_positions_ptr + row, tl.load(positions_ptr + row))
        tl.store(out_slots_ptr + row, tl.load(slots_ptr + row))
    elif row < tokens_pad:
        tl.store(out_slots_ptr + row, tl.full([], -1, tl.int64))
    if row < num_seqs:
        tl.store(out_context_lens_ptr + row, tl.load(context_lens_ptr + row))
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            entries = tl.load(block_tables_ptr + row * width + cols, mask=cols < width)
            tl.store(out_block_tables_ptr + row * stride_out_bt + cols, entries, mask=cols < width)
    elif row < seqs_pad:
        tl.store(out_context_lens_ptr + row, tl.full([], 0, tl.int32))
    if HAS_CU:
        if row <= num_seqs:
            tl.store(out_cu_query_lens_ptr + row, tl.load(cu_query_lens_ptr + row))
        elif row <= seqs_pad:
            tl.store(out_cu_query_lens_ptr + row, num_tokens.to(tl.int32))


def fill_graph_inputs(
    input_ids: torch.Tensor,  # [num_tokens] int64
    positions: torch.Tensor,  # [num_tokens] int64
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    context_lens: torch.Tensor,  # [num_seqs] int32
    cu_query_lens: torch.Tensor | None,  # [num_seqs + 1] int32; None: one token per sequence
    block_tables: torch.Tensor,  # [num_seqs, width] int32, contiguous
    pending_sources: torch.Tensor | None,  # [num_tokens] int64 row in `samples`, -1 = known
    samples: torch.Tensor | None,  # previous step's samples, int64 (needed with pending_sources)
    out: tuple[torch.Tensor, ...],  # ids, positions, slots, context lens, block tables[, cu]
    tokens_pad: int,  # token rows to fill: the live ones, then padding
    seqs_pad: int,  # sequence rows to fill (the cu entries: seqs_pad + 1)
) -> None:
    """Write token rows [0, tokens_pad) and sequence rows [0, seqs_pad) of the graph buffers
    `out`; with cu_query_lens, out's sixth buffer gets its entries [0, seqs_pad]."""
    num_tokens = input_ids.shape[0]
    num_seqs, width = block_tables.shape
    out_ids, out_positions, out_slots, out_context_lens, out_block_tables = out[:5]
    has_cu = cu_query_lens is not None
    out_cu = out[5] if has_cu else out_context_lens
    graph_tokens, graph_seqs = out_ids.shape[0], out_context_lens.shape[0]
    require(num_tokens <= tokens_pad <= graph_tokens, "tokens_pad not in [tokens, graph tokens]")
    require(num_seqs <= seqs_pad <= graph_seqs, "seqs_pad not in [seqs, graph sequences]")
    require(width <= out_block_tables.shape[1], "block tables are wider than the graph's")
    require(block_tables.is_contiguous(), "block_tables must be contiguous")
    require(not has_cu or out_cu.shape[0] > seqs_pad, "the graph's cu_query_lens are too short")
    has_pending = pending_sources is not None
    if has_pending:
        require(samples is not None, "pending_sources needs the samples they index")
    rows = max(tokens_pad, seqs_pad + 1 if has_cu else seqs_pad)
    _graph_inputs_kernel[(rows,)](
        input_ids,
        positions,
        slot_mapping,
        pending_sources if has_pending else input_ids,
        samples if has_pending else input_ids,
        context_lens,
        cu_query_lens if has_cu else context_lens,
        block_tables,
        out_ids,
        out_positions,
        out_slots,
        out_context_lens,
        out_cu,
        out_block_tables,
        num_tokens,
        num_seqs,
        tokens_pad,
        seqs_pad,
        width,
        out_block_tables.stride(0),
        HAS_PENDING=has_pending,
        HAS_CU=has_cu,
        BLOCK_W=64,
    )
