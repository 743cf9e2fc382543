"""Split-K for the quantized products (`int_gemv`, `int_dot`, `fp8_gemv`): the per-device
tile counters and partial buffers, the `_finish` epilogue (the last program of each output tile
sums the partials in split order) and the second kernel that sums them otherwise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.pdl import _start

COUNTERS = 1 << 16  # split-K counters per device (one per output tile)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """int32 [COUNTERS], zero between calls: each split-K tile's last program resets its own."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def split_k_buffers(
    split_k: int, m: int, n: int, device: torch.device
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(split_k, float32 partials [split_k, M, N] or a stand-in, the split-K counters)."""
    partial = torch.empty(split_k if split_k > 1 else 1, m if split_k > 1 else 1, n, device=device)
    return split_k, partial, _counters(device)


@triton.jit
def _finish(
    acc, out_ptr, partial_ptr, counter_ptr, tile, pid_k, split_k, offs_m, offs_n, M, N,
    LAST_REDUCES: tl.constexpr,
):  # fmt: skip
    """Store a program's [BLOCK_M, BLOCK_N] float32 result: the output itself without split-K;
    else its partial, and (LAST_REDUCES) the tile's last program sums all partials in split
    order into the output and resets the tile's counter."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    rows = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if split_k == 1:
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + pid_k * M * N + rows, acc, mask=mask)
        if LAST_REDUCES:
            tl.debug_barrier()  # every thread's partial is written before the release below
            done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == split_k - 1:
                total = tl.zeros_like(acc)
                for split in range(split_k):
                    total += tl.load(
                        partial_ptr + split * M * N + rows, mask=mask, other=0.0,
                        cache_modifier=".cg",
                    )  # fmt: skip
                tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(counter_ptr + tile, 0)


@triton.jit
def _sum_splits_kernel(
    partial_ptr, out_ptr, numel, split_k, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    _start(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(split_k):
        acc += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
