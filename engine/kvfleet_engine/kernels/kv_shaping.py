"""An fp8 cache's K rounded toward the queries, inside the store kernels (`kv_store` and the
fused rotary + store): `layers.kv_shaping`'s greedy moves (that module says why), on rows held as
two halves (as the fused kernel rotates them). M ~ W W^T + s I (`kv_shaping.KMoment`): each row
holds its kv head's W ([HALF, RANK] a half) in registers, W^T d once, then each move computes
M d = W (W^T d) + s d and adds one row of W to W^T d, all without reading memory."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import check_moment
from kvfleet_engine.kernels.kv_fp8 import to_codes
from kvfleet_engine.layers.kv_shaping import E4M3_TOP_MAGNITUDE, KMoment
from kvfleet_engine.layers.kv_shaping import SHAPE_STEPS as _STEPS

_TOP_MAGNITUDE = tl.constexpr(E4M3_TOP_MAGNITUDE)
SHAPE_STEPS = tl.constexpr(_STEPS)  # the store kernels' STEPS


def shaped_launch(
    moment: KMoment | None,
    k_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, Any]]:
    """A store kernel's factors and isotropic arguments and its SHAPED / RANK options, the
    moment checked (`checks.check_moment`); without one, the cache in their place (never read)."""
    if moment is None:
        return (k_cache, k_cache), {"SHAPED": False, "RANK": 1}
    check_moment(moment, k_cache, k_scales, num_kv_heads, head_dim)
    return (moment.factors, moment.isotropic), {"SHAPED": True, "RANK": moment.factors.shape[2]}


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
def _lowest_key(change, index):
    """int64 keys whose order is (change, index)'s: change's float32 bits made to sort as signed
    integers, above the index. One min over them gives a row's lowest change and, among equal
    ones, its first index (as torch's argmin picks)."""
    bits = change.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # floats' order as signed int32 (-0.0 -> -1)
    return (ordered.to(tl.int64) << 32) | index.to(tl.int64)


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
    `layers.kv_shaping.shaped_e4m3` moves them. Per move, two reductions along each row: one
    min over (change, index) keys for the move, one sum for W's row of the moved element."""
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
    projected = tl.sum(error1[:, :, None] * w1 + error2[:, :, None] * w2, axis=1)  # W^T d
    diagonal1 = tl.sum(w1 * w1, axis=2) + isotropic
    diagonal2 = tl.sum(w2 * w2, axis=2) + isotropic
    index1, index2 = cols + 0 * heads, cols + HALF + 0 * heads
    for _ in range(STEPS):
        weights = projected[:, None, :]  # M d = W (W^T d) + s d
        gradient1 = tl.sum(w1 * weights, axis=2) + isotropic * error1
        gradient2 = tl.sum(w2 * weights, axis=2) + isotropic * error2
        change1 = (2.0 * gradient1 + step1 * diagonal1) * step1
        change2 = (2.0 * gradient2 + step2 * diagonal2) * step2
        keys = tl.minimum(_lowest_key(change1, index1), _lowest_key(change2, index2))
        lowest = tl.min(keys, axis=1)[:, None]
        best = (lowest & 0x7FFFFFFF).to(tl.int32)
        lowers = (lowest >> 32).to(tl.int32) < -1  # the change is below -0.0: it lowers d^T M d
        move1 = tl.where((index1 == best) & lowers, step1, 0.0)
        move2 = tl.where((index2 == best) & lowers, step2, 0.0)
        # Only the moved element changes (adding 0 would turn a -0 code into +0).
        codes1 = tl.where(move1 != 0.0, codes1 + move1, codes1)
        codes2 = tl.where(move2 != 0.0, codes2 + move2, codes2)
        error1, error2 = codes1 - scaled1, codes2 - scaled2
        step1 = tl.where(move1 != 0.0, -step1, step1)
        step2 = tl.where(move2 != 0.0, -step2, step2)
        projected += tl.sum(move1[:, :, None] * w1 + move2[:, :, None] * w2, axis=1)
    return codes1.to(tl.float8e4nv), codes2.to(tl.float8e4nv)
