"""Residual add + RMSNorm in one pass (the decoder layer's two norms): eager torch runs the add,
the mean of squares, the scale and the weight as separate kernels, each a round trip to memory
and, at batch 1, a few microseconds of launch latency. With `fp8_out`, the normalized rows come
out as per-token e4m3 (`fp8_rows.Fp8Rows`) for a W8A8 product: `quantize_fp8_rows` of the
16-bit output, which is then never written. On a GPU the two compiled variants may sum a row's
squares in different orders; where that rounds the row's scale 1/rms apart, a code is the next
e4m3 value (rare; `test_gpu_rms_norm_fp8_out_llama`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import next_power_of_2, require
from kvfleet_engine.kernels.fp8_rows import Fp8Rows, _store_fp8_row, fp8_rows_like
from kvfleet_engine.kernels.pdl import _start, launch_options
from kvfleet_engine.quant.layout import FP8_MAX


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    scale_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
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
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    if FP8_OUT:  # the x-dtype row, as per-token e4m3 (its scale to scale_ptr)
        _store_fp8_row(out.to(tl.float32), out_ptr + row * stride_o + cols, scale_ptr + row, mask,
                       FP8_MAX_VALUE)  # fmt: skip
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., dim], added to x first
    fp8_out: bool = False,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor | None]:
    """(weight * normalize(x + residual), x + residual) — the second is None without residual.
    With fp8_out the first is the normalized rows [rows, dim] as per-token e4m3."""
    dim = x.shape[-1]
    require(weight.shape == (dim,), f"weight must be [{dim}]")
    require(x.stride(-1) == 1, "x must be contiguous in its last dimension")
    rows = x.reshape(-1, dim)
    if fp8_out:
        codes, scale = fp8_rows_like(rows)
        out = codes
    else:
        out, scale = torch.empty(rows.shape, dtype=x.dtype, device=x.device), None
    residual_out = None
    if residual is not None:
        require(residual.shape == x.shape, "residual must have the shape of x")
        residual_rows = residual.reshape(-1, dim)
        residual_out = torch.empty_like(rows)
    else:
        residual_rows = rows
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            residual_rows,
            weight,
            out,
            scale if scale is not None else out,
            residual_out if residual_out is not None else out,
            rows.stride(0),
            residual_rows.stride(0),
            out.stride(0),
            out.stride(0),
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            FP8_OUT=fp8_out,
            FP8_MAX_VALUE=FP8_MAX,
            BLOCK=next_power_of_2(dim),
            num_warps=4 if dim <= 4096 else 8,
            **launch_options(x.device),
        )
    summed = residual_out.view(x.shape) if residual_out is not None else None
    if scale is not None:
        return Fp8Rows(codes, scale), summed
    return out.view(x.shape), summed
