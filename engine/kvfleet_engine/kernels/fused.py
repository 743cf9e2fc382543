"""Fused element-wise kernels for the decoder layer: residual add + RMSNorm in one pass, and
rotary embedding applied in place to q and k. Each replaces a chain of small torch ops (one
launch and one round trip to memory each) that dominates a batch-1 step's non-matmul time."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import next_power_of_2, require


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
):
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
        )
    out = out.view(x.shape)
    return out, (residual_out.view(x.shape) if residual_out is not None else None)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    cos = tl.load(cos_sin_ptr + position * stride_cs + cols, mask=col_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + cols, mask=col_mask, other=0.0)
    heads = tl.arange(0, BLOCK_H)[:, None]
    for which in tl.static_range(2):
        if which == 0:
            base = query_ptr + token * stride_qt + heads * stride_qh
            mask = (heads < num_q_heads) & col_mask[None, :]
        else:
            base = key_ptr + token * stride_kt + heads * stride_kh
            mask = (heads < num_kv_heads) & col_mask[None, :]
        x1 = tl.load(base + cols[None, :], mask=mask, other=0.0)
        x2 = tl.load(base + HALF + cols[None, :], mask=mask, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base + cols[None, :], (f1 * cos - f2 * sin).to(x1.dtype), mask=mask)
        tl.store(base + HALF + cols[None, :], (f2 * cos + f1 * sin).to(x1.dtype), mask=mask)


def rotary_embedding_(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin: torch.Tensor,  # [max_positions, head_dim] float32: cos | sin halves
) -> None:
    """Rotate-half (NeoX) rotary embedding, in place."""
    num_tokens, num_q_heads, head_dim = query.shape
    require(key.shape[0] == num_tokens and key.shape[2] == head_dim, "key must match query")
    require(query.stride(-1) == 1 and key.stride(-1) == 1, "q/k must be contiguous in head_dim")
    require(cos_sin.shape[1] == head_dim and cos_sin.dtype == torch.float32, "cos_sin layout")
    require(positions.dtype == torch.int64, "positions must be int64")
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin.stride(0),
        num_q_heads,
        key.shape[1],
        HALF=half,
        BLOCK_H=next_power_of_2(max(num_q_heads, key.shape[1])),
        BLOCK_HALF=next_power_of_2(half),
    )
