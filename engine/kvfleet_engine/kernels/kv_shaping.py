"""An fp8 cache's K rounded toward the queries, inside the store kernels (`kv_store` and the
fused rotary + store): `layers.kv_shaping`'s greedy moves (that module says why), on rows held as
two halves (as the fused kernel rotates them). M ~ W W^T + s I (`kv_shaping.KMoment`): each row
holds its kv head's W ([HALF, RANK] a half) in registers, W^T d once, then each move computes
M d = W (W^T d) + s d and adds one row of W to W^T d, all without reading memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.kv_fp8 import to_codes
from kvfleet_engine.layers.kv_shaping import E4M3_TOP_MAGNITUDE, KMoment
from kvfleet_engine.layers.kv_shaping import SHAPE_STEPS as _STEPS

_TOP_MAGNITUDE = tl.constexpr(E4M3_TOP_MAGNITUDE)
SHAPE_STEPS = tl.constexpr(_STEPS)  # the store kernels' STEPS


def shaped_args(
    moment: KMoment | None, placeholder: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A store kernel's factors and isotropic arguments (without a moment: `placeholder`, never
    read)."""
    if moment is None:
        return placeholder, placeholder
    return moment.factors, moment.isotropic


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
def _times_factors(projected, w1, w2, isotropic, error1, error2):
    """M d as halves: W (W^T d) + s d, from projected = W^T d [rows, RANK]."""
    weights = projected[:, None, :]
    return (
        tl.sum(w1 * weights, axis=2) + isotropic * error1,
        tl.sum(w2 * weights, axis=2) + isotropic * error2,
    )


@triton.jit
def shaped_e4m3_halves(
    x1,  # [rows, BLOCK_HALF] float: each row's first half (0 where masked)
    x2,  # [rows, BLOCK_HALF]: its second half
    inverse,  # [rows, 1] float32: each row's 1 / scale (`kv_fp8.kv_scales`)
    factors_ptr,  # [num_kv_heads, 2 HALF, RANK] float32: W (`kv_shaping.KMoment`)
    isotropic_ptr,  # [num_kv_heads] float32: s
    heads,  # [rows, 1]: each row's kv head
    cols,  # [1, BLOCK_HALF]
    mask,  # [rows, BLOCK_HALF]
    HALF: tl.constexpr,
    STEPS: tl.constexpr,
    RANK: tl.constexpr,
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
    rank = tl.arange(0, RANK)[None, None, :]
    w_rows = factors_ptr + heads[:, :, None] * (DIM * RANK) + cols[:, :, None] * RANK + rank
    w_mask = mask[:, :, None]
    w1 = tl.load(w_rows, mask=w_mask, other=0.0)  # [rows, BLOCK_HALF, RANK]
    w2 = tl.load(w_rows + HALF * RANK, mask=w_mask, other=0.0)
    isotropic = tl.load(isotropic_ptr + heads + 0 * cols, mask=mask, other=0.0)  # each row's s
    error1, error2 = codes1 - scaled1, codes2 - scaled2
    projected = tl.sum(error1[:, :, None] * w1, axis=1) + tl.sum(error2[:, :, None] * w2, axis=1)
    diagonal1 = tl.sum(w1 * w1, axis=2) + isotropic
    diagonal2 = tl.sum(w2 * w2, axis=2) + isotropic
    for _ in range(STEPS):
        gradient1, gradient2 = _times_factors(projected, w1, w2, isotropic, error1, error2)
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
        error1, error2 = codes1 - scaled1, codes2 - scaled2
        step1 = tl.where(at1 & (move != 0.0), -step1, step1)
        step2 = tl.where(at2 & (move != 0.0), -step2, step2)
        row1 = tl.sum(tl.where(at1[:, :, None], w1, 0.0), axis=1)  # W's row of the move
        row2 = tl.sum(tl.where(at2[:, :, None], w2, 0.0), axis=1)
        projected += move * (row1 + row2)
    return codes1.to(tl.float8e4nv), codes2.to(tl.float8e4nv)
