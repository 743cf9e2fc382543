"""Matrix-vector product for one-token decode steps: out[N] = W[N, K] @ x[K].

At batch 1 a decode step is a stream of weight reads. cuBLAS covers the narrow projections
(N = hidden size) with a split-K GEMM plus a separate reduction kernel, two launches per layer
each; here each program owns BLOCK_N whole rows and reduces over K itself, so every product is
one launch. Rows are read with 16-byte vector loads, accumulated in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import FLOAT_DTYPES, require


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K], rows contiguous
    out_ptr,  # [N]
    num_rows,
    num_cols,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, num_cols, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_mask = cols < num_cols
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
        w = tl.load(
            w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row_mask)


def gemv(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K]
    *,
    block_n: int = 4,
    block_k: int = 1024,
    num_warps: int = 4,
) -> torch.Tensor:  # [1, N]
    """x @ weight.T for a single row x (what F.linear(x, weight) computes)."""
    require(x.dim() == 2 and x.shape[0] == 1, "x must be [1, K]")
    require(weight.dim() == 2 and weight.shape[1] == x.shape[1], "weight must be [N, K]")
    require(x.dtype == weight.dtype and x.dtype in FLOAT_DTYPES, "x and weight: one float dtype")
    require(weight.stride(1) == 1 and x.is_contiguous(), "rows must be contiguous")
    num_rows, num_cols = weight.shape
    out = torch.empty((1, num_rows), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(num_rows, block_n),)](
        x,
        weight,
        out,
        num_rows,
        num_cols,
        weight.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out
