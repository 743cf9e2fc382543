"""An fp8 cache's K rounded toward the queries, inside the store kernels (`kv_store` and the
fused rotary + store): `layers.kv_shaping`'s greedy moves (that module says why), on rows held as
two halves (as the fused kernel rotates them). Each row's gradient M d is built column by column
from its kv head's moment (one row of M a column), then each move reads the one row of M its
element needs."""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet_engine.kernels.kv_fp8 import to_codes
from kvfleet_engine.layers.kv_shaping import E4M3_TOP_MAGNITUDE
from kvfleet_engine.layers.kv_shaping import SHAPE_STEPS as _STEPS

_TOP_MAGNITUDE = tl.constexpr(E4M3_TOP_MAGNITUDE)
SHAPE_STEPS = tl.constexpr(_STEPS)  # the store kernels' STEPS


@triton.jit
def other_code(scaled, codes):
    """`layers.kv_shaping.other_code`: the e4m3 code on the other side of each scaled element
    from its nearest code (float32 values; where scaled is a code, that code)."""
    bits = codes.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    magnitude = bits & 0x7F
    sign = bits & 0x80
    away = tl.abs(codes) > tl.abs(scaled)
    magnitude = tl.where(away, magnitude - 1, tl.minimum(magnitude + 1, _TOP_MAGNITUDE))
    zero = codes == 0.0
    magnitude = tl.where(zero, 1, magnitude)
    sign = tl.where(zero, tl.where(scaled < 0.0, 0x80, 0), sign)
    other = (sign | magnitude).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.where(codes == scaled, codes, other)


@triton.jit
def _column(x1, x2, cols, j, HALF: tl.constexpr):
    """Column j of the rows [x1 | x2] ([rows, BLOCK_HALF] halves): [rows]."""
    return tl.sum(tl.where(cols == j, x1, 0.0), axis=1) + tl.sum(
        tl.where(cols == j - HALF, x2, 0.0), axis=1
    )


@triton.jit
def shaped_e4m3_halves(
    x1,  # [rows, BLOCK_HALF] float: each row's first half (0 where masked)
    x2,  # [rows, BLOCK_HALF]: its second half
    inverse,  # [rows, 1] float32: each row's 1 / scale (`kv_fp8.kv_scales`)
    moment_ptr,  # [num_kv_heads, 2 HALF, 2 HALF] float32
    heads,  # [rows, 1]: each row's kv head
    cols,  # [1, BLOCK_HALF]
    mask,  # [rows, BLOCK_HALF]
    HALF: tl.constexpr,
    STEPS: tl.constexpr,
):
    """e4m3 codes of the rows [x1 | x2] times inverse, as halves, moved from nearest as
    `layers.kv_shaping.shaped_e4m3` moves them (a row's move goes to its first lowest change,
    as torch's argmin picks)."""
    DIM: tl.constexpr = 2 * HALF
    scaled1, scaled2 = x1.to(tl.float32) * inverse, x2.to(tl.float32) * inverse
    codes1 = to_codes(x1, inverse, tl.float8e4nv).to(tl.float32)
    codes2 = to_codes(x2, inverse, tl.float8e4nv).to(tl.float32)
    step1 = tl.where(mask, other_code(scaled1, codes1) - codes1, 0.0)
    step2 = tl.where(mask, other_code(scaled2, codes2) - codes2, 0.0)
    error1, error2 = codes1 - scaled1, codes2 - scaled2
    rows = moment_ptr + heads * (DIM * DIM)
    gradient1 = tl.zeros_like(scaled1)  # M d, as halves
    gradient2 = tl.zeros_like(scaled2)
    for j in range(DIM):  # M d = sum over columns j of d_j M[j, :]
        error_j = _column(error1, error2, cols, j, HALF)[:, None]
        gradient1 += error_j * tl.load(rows + j * DIM + cols, mask=mask, other=0.0)
        gradient2 += error_j * tl.load(rows + j * DIM + HALF + cols, mask=mask, other=0.0)
    diagonal1 = tl.load(rows + cols * (DIM + 1), mask=mask, other=0.0)
    diagonal2 = tl.load(rows + (HALF + cols) * (DIM + 1), mask=mask, other=0.0)
    for _ in range(STEPS):
        change1 = (2.0 * gradient1 + step1 * diagonal1) * step1
        change2 = (2.0 * gradient2 + step2 * diagonal2) * step2
        lowest1, lowest2 = tl.min(change1, axis=1), tl.min(change2, axis=1)
        best = tl.where(
            lowest1 <= lowest2, tl.argmin(change1, axis=1), HALF + tl.argmin(change2, axis=1)
        )[:, None]
        at1, at2 = cols == best, cols == best - HALF
        move = _column(step1, step2, cols, best, HALF)[:, None]
        move = tl.where(tl.minimum(lowest1, lowest2)[:, None] < 0.0, move, 0.0)
        codes1, codes2 = tl.where(at1, codes1 + move, codes1), tl.where(at2, codes2 + move, codes2)
        step1 = tl.where(at1 & (move != 0.0), -step1, step1)
        step2 = tl.where(at2 & (move != 0.0), -step2, step2)
        gradient1 += move * tl.load(rows + best * DIM + cols, mask=mask, other=0.0)
        gradient2 += move * tl.load(rows + best * DIM + HALF + cols, mask=mask, other=0.0)
    return codes1.to(tl.float8e4nv), codes2.to(tl.float8e4nv)
