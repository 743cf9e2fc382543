"""SiLU-and-multiply for the gated MLP in one kernel: eager torch runs `F.silu(gate) * up` as two
launches and writes the SiLU output to memory in between."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import FLOAT_DTYPES, next_power_of_2, require
from kvfleet_engine.kernels.pdl import _start, launch_options

# Columns per program: a batch-1 row of Llama-3.1-8B (14,336 columns) spreads over 28 programs.
BLOCK_COLS = 512


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    inner,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    _start(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_x + inner + cols, mask=mask, other=0.0)
    tl.store(out_ptr + token * stride_o + cols, _silu_mul(gate, up), mask=mask)


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in gate's dtype, rounded as eager torch: the SiLU, then the product."""
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded like torch's F.silu output
    return (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * inner]
    """silu(gate) * up of x = [gate | up] (MergedLinear's layout) -> [num_tokens, inner].

    Rounds like eager `F.silu(gate) * up` does: the SiLU to x's dtype, then the product, so the
    result is bit-for-bit what transformers computes, up to the last bit of exp."""
    require(x.dim() == 2, "x must be [num_tokens, 2 * inner]")
    require(x.shape[1] % 2 == 0, "x must have an even number of columns (gate | up)")
    require(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}")
    require(x.stride(-1) == 1, "x must be contiguous in its last dimension")
    num_tokens, inner = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inner), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or inner == 0:
        return out
    block = min(BLOCK_COLS, next_power_of_2(inner))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inner, block))](
        x, out, x.stride(0), out.stride(0), inner, BLOCK=block, **launch_options(x.device)
    )
    return out
