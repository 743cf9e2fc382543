"""Residual add + RMSNorm in one pass (the decoder layer's two norms): eager torch runs the add,
the mean of squares, the scale and the weight as separate kernels, each a round trip to memory
and, at batch 1, a few microseconds of launch latency."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import next_power_of_2, require
from kvfleet_engine.kernels.pdl import _start, launch_options


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    _start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # rounded like torch's add
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    normed = (xf * rstd).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., dim], added to x first
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * normalize(x + residual), x + residual) — the second is None without residual."""
    dim = x.shape[-1]
    require(weight.shape == (dim,), f"weight must be [{dim}]")
    require(x.stride(-1) == 1, "x must be contiguous in its last dimension")
    rows = x.reshape(-1, dim)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    residual_out = None
    if residual is not None:
        require(residual.shape == x.shape, "residual must have the shape of x")
        residual_rows = residual.reshape(-1, dim)
        residual_out = torch.empty_like(out)
    else:
        residual_rows = rows
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            residual_rows,
            weight,
            out,
            residual_out if residual_out is not None else out,
            rows.stride(0),
            residual_rows.stride(0),
            out.stride(0),
            out.stride(0),
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=next_power_of_2(dim),
            num_warps=4 if dim <= 4096 else 8,
            **launch_options(x.device),
        )
    out = out.view(x.shape)
    return out, (residual_out.view(x.shape) if residual_out is not None else None)
