"""Per-token e4m3 rows: the activation side of the W8A8 products (`fp8_matmul`).

A row's scale is max|x| / FP8_MAX (at least 1e-12 / FP8_MAX) and its codes x / scale, rounded to
nearest, as `quant.layout.quantize_fp8_rows`. Two ways to get them:
- `quantize_fp8_rows(x)`: from rows already in memory, one program per row. A row of up to
  ROW_MAX_COLS columns is read once and held in registers; a wider one is read twice (max, then
  codes).
- `silu_and_mul_fp8(gate_up)`: the gated MLP's silu(gate) * up made and quantized in one kernel,
  so the down projection's input (the widest activation of a layer: 14,336 columns in
  Llama-3.1-8B) is never written in 16 bits and read back. Its codes and scales equal
  `quantize_fp8_rows(activation.silu_and_mul(gate_up))` bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.activation import _silu_mul
from kvfleet_engine.kernels.checks import FLOAT_DTYPES, next_power_of_2, require
from kvfleet_engine.kernels.pdl import _start, launch_options
from kvfleet_engine.quant.layout import FP8_DTYPE, FP8_MAX

ROW_MAX_COLS = 32768  # the widest row one program quantizes from registers


class Fp8Rows(NamedTuple):
    """Rows quantized per token: x ≈ codes * scale."""

    codes: torch.Tensor  # float8_e4m3fn [M, K]
    scale: torch.Tensor  # float32 [M, 1]


def row_warps(block: int) -> int:
    """Warps of a program holding a row of `block` columns: ~32 float32 values per thread."""
    return max(4, min(16, block // 1024))


@triton.jit
def _store_fp8_row(values, q_ptrs, scale_ptr, mask, FP8_MAX_VALUE: tl.constexpr):
    """One row held in registers (float32; masked lanes 0): its scale to scale_ptr, its e4m3
    codes to q_ptrs."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(values), axis=0), 1e-12), FP8_MAX_VALUE)
    tl.store(scale_ptr, scale)
    q = tl.math.div_rn(values, scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX_VALUE), FP8_MAX_VALUE)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, x_q_ptr, scale_ptr, K, stride_xm,
    FP8_MAX_VALUE: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:  # BLOCK_K >= K: the row in registers
        offs = tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0)
        _store_fp8_row(x.to(tl.float32), x_q_ptr + row * K + offs, scale_ptr + row, offs < K,
                       FP8_MAX_VALUE)  # fmt: skip
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax), 1e-12), FP8_MAX_VALUE)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0)
            q = tl.math.div_rn(x.to(tl.float32), scale)
            q = tl.minimum(tl.maximum(q, -FP8_MAX_VALUE), FP8_MAX_VALUE)
            tl.store(x_q_ptr + row * K + offs, q.to(x_q_ptr.dtype.element_ty), mask=offs < K)


def fp8_rows_like(x: torch.Tensor, k: int | None = None) -> Fp8Rows:
    """Empty codes [M, k (x's columns)] and scales [M, 1] for the rows of x [M, K]."""
    m = x.shape[0]
    codes = torch.empty(m, x.shape[1] if k is None else k, device=x.device, dtype=FP8_DTYPE)
    return Fp8Rows(codes, torch.empty(m, 1, device=x.device, dtype=torch.float32))


def quantize_fp8_rows(x: torch.Tensor) -> Fp8Rows:
    """Per-token e4m3 of x [M, K] -> (x_q [M, K], float32 scale [M, 1]), as the layout's."""
    require(x.dim() == 2, f"x must be [M, K], got shape {tuple(x.shape)}")
    require(x.stride(-1) == 1, "x must be contiguous in its last dimension")
    m, k = x.shape
    x_q, scale = fp8_rows_like(x)
    if m > 0:
        one_pass = k <= ROW_MAX_COLS
        block = next_power_of_2(k) if one_pass else 2048
        _quantize_rows_kernel[(m,)](
            x, x_q, scale, k, x.stride(0), FP8_MAX_VALUE=FP8_MAX, BLOCK_K=block,
            ONE_PASS=one_pass, num_warps=row_warps(block) if one_pass else 4,
        )  # fmt: skip
    return Fp8Rows(x_q, scale)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, inner,
    FP8_MAX_VALUE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    _start(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_x + inner + cols, mask=mask, other=0.0)
    out = _silu_mul(gate, up).to(tl.float32)  # rounded to x's dtype, as the unfused kernel's
    _store_fp8_row(out, q_ptr + token * inner + cols, scale_ptr + token, mask, FP8_MAX_VALUE)


def silu_and_mul_fp8(gate_up: torch.Tensor) -> Fp8Rows:
    """Per-token e4m3 of silu(gate) * up for gate_up = [gate | up] [M, 2 * inner] -> (x_q
    [M, inner], float32 scale [M, 1]); inner up to ROW_MAX_COLS."""
    require(gate_up.dim() == 2, "gate_up must be [num_tokens, 2 * inner]")
    require(gate_up.shape[1] % 2 == 0, "gate_up must have an even number of columns")
    require(gate_up.dtype in FLOAT_DTYPES, f"gate_up dtype must be one of {FLOAT_DTYPES}")
    require(gate_up.stride(-1) == 1, "gate_up must be contiguous in its last dimension")
    m, inner = gate_up.shape[0], gate_up.shape[1] // 2
    require(0 < inner <= ROW_MAX_COLS, f"inner size {inner} is not in 1..{ROW_MAX_COLS}")
    x_q, scale = fp8_rows_like(gate_up, inner)
    if m > 0:
        block = next_power_of_2(inner)
        _silu_and_mul_fp8_kernel[(m,)](
            gate_up, x_q, scale, gate_up.stride(0), inner, FP8_MAX_VALUE=FP8_MAX, BLOCK=block,
            num_warps=row_warps(block), **launch_options(gate_up.device),
        )  # fmt: skip
    return Fp8Rows(x_q, scale)
