"""An fp8 cache's K rounded toward the queries, inside the store kernel: `layers.kv_shaping`'s
greedy moves (that module says why), on rows of registers. Each row's gradient M d is built
column by column from its kv head's moment (one [head_dim] row of M a column), then each move
reads the one row of M its element needs."""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet_engine.kernels.kv_fp8 import to_codes
from kvfleet_engine.layers.kv_shaping import E4M3_TOP_MAGNITUDE

_TOP_MAGNITUDE = tl.constexpr(E4M3_TOP_MAGNITUDE)


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
def shaped_e4m3(
    x,  # [rows, BLOCK_D] float rows (0 where masked)
    inverse,  # [rows, 1] float32: each row's 1 / scale (`kv_fp8.kv_scales`)
    moment_ptr,  # [num_kv_heads, HEAD_DIM, HEAD_DIM] float32
    heads,  # [rows, 1]: each row's kv head
    dims,  # [1, BLOCK_D]
    mask,  # [rows, BLOCK_D]
    HEAD_DIM: tl.constexpr,
    STEPS: tl.constexpr,
):
    """e4m3 codes [rows, BLOCK_D] of x times inverse, moved from nearest as
    `layers.kv_shaping.shaped_e4m3` moves them."""
    scaled = x.to(tl.float32) * inverse
    codes = to_codes(x, inverse, tl.float8e4nv).to(tl.float32)
    step = tl.where(mask, other_code(scaled, codes) - codes, 0.0)
    error = codes - scaled
    rows = moment_ptr + heads * (HEAD_DIM * HEAD_DIM)
    gradient = tl.zeros_like(scaled)
    for j in range(HEAD_DIM):  # M d = sum over columns j of d_j M[j, :]
        error_j = tl.sum(tl.where(dims == j, error, 0.0), axis=1)
        gradient += error_j[:, None] * tl.load(rows + j * HEAD_DIM + dims, mask=mask, other=0.0)
    diagonal = tl.load(rows + dims * (HEAD_DIM + 1), mask=mask, other=0.0)
    for _ in range(STEPS):
        change = (2.0 * gradient + step * diagonal) * step
        best = tl.argmin(change, axis=1)
        at = dims == best[:, None]
        move = tl.sum(tl.where(at, step, 0.0), axis=1)
        move = tl.where(tl.min(change, axis=1) < 0.0, move, 0.0)[:, None]
        codes = tl.where(at, codes + move, codes)
        step = tl.where(at & (move != 0.0), -step, step)
        best_row = tl.load(rows + best[:, None] * HEAD_DIM + dims, mask=mask, other=0.0)
        gradient += move * best_row
    return codes.to(tl.float8e4nv)
