"""Test weights in every GGUF tensor type the engine reads, and a bound on how far they read back.

gguf-py quantizes the float types and the 32-value block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
but only dequantizes the K-quants. This module adds a small numpy quantizer for each K-quant,
writing 256-value super-blocks in the layout of llama.cpp's `block_q2_K` … `block_q6_K`, which
is the layout `gguf.quants.dequantize` decodes:

    raw = quantize(w, Q4_K)  # w: float32 [rows, cols] -> uint8 [rows, cols // 256 * 144]
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=Q4_K)
    assert abs(gguf.quants.dequantize(raw, Q4_K) - w).max() <= tolerance(w, Q4_K)

The K-quant quantizers are plain, not llama.cpp's searched ones: each 16- or 32-value sub-block
gets the smallest step that spans its values (its absmax for the symmetric Q3_K and Q6_K, its
min..max for Q2_K, Q4_K and Q5_K), and the sub-block steps and mins are rounded *up* to whole
multiples of the super-block's f16 scales, so no value clips and each lies within half its
sub-block's step. `tolerance` bounds that half step from the data and the format's bit widths;
for gguf-py's types it follows their quantizers (half a step, a whole one at Q4_0 / Q5_0's
clipped top level), each plus the f16 rounding of the stored scales.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
SUPPORTED = (
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
)  # fmt: skip
QK_K = 256  # values in a K-quant super-block


def quantize(weights: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`weights` as GGUF stores them in `qtype`: uint8 [rows, bytes_per_row] for block types,
    float32 / float16 [rows, cols] for F32 / F16 (pass to `GGUFWriter.add_tensor(...,
    raw_dtype=qtype)`)."""
    _check(weights, qtype)
    if qtype not in _K_QUANTS:
        return gguf.quants.quantize(weights, qtype)
    blocks = weights.astype(np.float64).reshape(-1, QK_K)  # [num_blocks, 256]
    return _K_QUANTS[qtype](blocks).reshape(weights.shape[0], -1)


def tolerance(weights: np.ndarray, qtype: GGMLQuantizationType) -> float:
    """An upper bound on max |dequantize(quantize(weights)) - weights| in `qtype`."""
    _check(weights, qtype)
    if qtype == T.F32:
        return 0.0
    block_size = GGML_QUANT_SIZES[qtype][0]
    blocks = weights.astype(np.float64).reshape(-1, block_size)  # [num_blocks, block_size]
    # float32 rounding in the dequantizer's multiply-add, and in gguf-py's float32 quantizers
    arithmetic = 8 * np.finfo(np.float32).eps * np.abs(blocks).max(axis=1)
    return float((_BOUNDS[qtype](blocks) + arithmetic).max())


def _check(weights: np.ndarray, qtype: GGMLQuantizationType) -> None:
    if qtype not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise ValueError(f"qtype: {qtype!r} is not one of {names}")
    if weights.dtype != np.float32 or weights.ndim != 2:
        raise ValueError(f"weights: need float32 [rows, cols], got {weights.dtype} {weights.shape}")
    unit = max(GGML_QUANT_SIZES[qtype][0], 32)
    if weights.shape[1] % unit:
        raise ValueError(
            f"weights: {qtype.name} needs cols a multiple of {unit}, got {weights.shape}"
        )


# --- K-quant quantizers: blocks float64 [n, 256] -> uint8 [n, type_size], fields in file order.


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    # 16 sub-blocks of 16; value = d * scale * q - dmin * min, q in 0..3, scale and min 4-bit
    d, scales, dmin, mins, q = _affine(blocks.reshape(-1, 16, 16), levels=4, scale_max=15)
    scale_bytes = (scales | (mins << 4)).astype(np.uint8)  # [n, 16]
    return np.concatenate([scale_bytes, _pack(q, 4, 32), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    # 16 sub-blocks of 16; value = d * scale * q, q in -4..3 (2 low + 1 high bit), 6-bit scale
    d, scales, q = _symmetric(blocks.reshape(-1, 16, 16), levels=8, scale_max=31)
    u, s = q + 4, scales + 32  # stored unsigned
    hmask, qs = _pack(u >> 2, 8, 32), _pack(u, 4, 32)  # [n, 32], [n, 64]
    scale_bytes = np.concatenate([_pack(s, 2, 8), _pack(s >> 4, 4, 4)], axis=1)  # [n, 12]
    return np.concatenate([hmask, qs, scale_bytes, _f16_bytes(d)], axis=1)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    # 8 sub-blocks of 32; value = d * scale * q - dmin * min, q in 0..15, scale and min 6-bit
    d, scales, dmin, mins, q = _affine(blocks.reshape(-1, 8, 32), levels=16, scale_max=63)
    head = [_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(scales, mins)]
    return np.concatenate([*head, _pack(q, 2, 32)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    # as Q4_K with q in 0..31: the fifth bits of all 256 values in 32 bytes before the nibbles
    d, scales, dmin, mins, q = _affine(blocks.reshape(-1, 8, 32), levels=32, scale_max=63)
    head = [_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(scales, mins)]
    return np.concatenate([*head, _pack(q >> 4, 8, 32), _pack(q, 2, 32)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    # 16 sub-blocks of 16; value = d * scale * q, q in -32..31 (4 low bits + 2 high), scale int8
    d, scales, q = _symmetric(blocks.reshape(-1, 16, 16), levels=64, scale_max=127)
    u = q + 32  # stored unsigned
    ql, qh = _pack(u, 2, 64), _pack(u >> 4, 4, 32)  # [n, 128], [n, 64]
    scale_bytes = scales.astype(np.int8).view(np.uint8)  # [n, 16]
    return np.concatenate([ql, qh, scale_bytes, _f16_bytes(d)], axis=1)


_K_QUANTS = {T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


def _symmetric(x: np.ndarray, levels: int, scale_max: int) -> tuple[np.ndarray, ...]:
    """x: [n, subs, size] -> d f16 [n], scales int [n, subs] in 0..scale_max, q int [n, subs,
    size] in -levels/2..levels/2-1. The levels span ±(levels/2 - 1/2) steps to within half a
    step, so the step that covers a sub-block's absmax is absmax / (levels/2 - 1/2)."""
    needed = np.abs(x).max(axis=2) / (levels / 2 - 0.5)  # [n, subs]
    d = _f16_up(needed.max(axis=1) / scale_max)  # [n]
    scales = _ceil_div(needed, d[:, None])
    q = _round_div(x, scales * d[:, None].astype(np.float64))
    assert scales.max(initial=0) <= scale_max
    return d, scales, np.clip(q, -levels // 2, levels // 2 - 1)


def _affine(x: np.ndarray, levels: int, scale_max: int) -> tuple[np.ndarray, ...]:
    """x: [n, subs, size] -> d, dmin f16 [n]; scales, mins int [n, subs] in 0..scale_max; q int
    [n, subs, size] in 0..levels-1. The format only subtracts mins, so a sub-block's low end is
    min(its min, 0); mins * dmin is rounded up to reach below that low end, and the step up so
    that levels-1 steps from there reach above its max."""
    low = np.minimum(x.min(axis=2), 0)  # [n, subs]
    dmin = _f16_up(-low.min(axis=1) / scale_max)  # [n]
    mins = _ceil_div(-low, dmin[:, None])
    offset = mins * dmin[:, None].astype(np.float64)  # >= -low, by less than dmin
    needed = (x.max(axis=2) + offset) / (levels - 1)  # [n, subs]
    d = _f16_up(needed.max(axis=1) / scale_max)  # [n]
    scales = _ceil_div(needed, d[:, None])
    q = _round_div(x + offset[..., None], scales * d[:, None].astype(np.float64))
    assert max(scales.max(initial=0), mins.max(initial=0)) <= scale_max
    return d, scales, dmin, mins, np.clip(q, 0, levels - 1)


def _pack(q: np.ndarray, fields: int, width: int) -> np.ndarray:
    """Interleave runs of `width` values into bytes, `fields` runs per byte: value i of run f
    goes to bits f * (8 // fields) of byte i of its group (the higher bits of q are dropped).
    q: int [n, ...] with groups * fields * width values a row -> uint8 [n, groups * width]."""
    bits = 8 // fields
    runs = (q.reshape(q.shape[0], -1, fields, width) & (2**bits - 1)).astype(np.uint8)
    shifts = (bits * np.arange(fields, dtype=np.uint8))[:, None]  # [fields, 1]
    return np.bitwise_or.reduce(runs << shifts, axis=2).reshape(q.shape[0], -1)


def _pack_scales_mins(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 scale bytes from 8 6-bit scales and mins [n, 8]: bytes 0-3 hold scales
    0-3, 4-7 mins 0-3, each with the top 2 bits of scale / min j+4 above; 8-11 the low nibbles of
    scale j+4 (low) and min j+4 (high)."""
    low_scales = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    low_mins = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    high_nibbles = (scales[:, 4:] & 0xF) | ((mins[:, 4:] & 0xF) << 4)
    return np.concatenate([low_scales, low_mins, high_nibbles], axis=1).astype(np.uint8)


def _f16_up(x: np.ndarray) -> np.ndarray:
    """x rounded to float16, then up one unit where rounding went below x."""
    h = x.astype(np.float16)
    return np.where(h < x, np.nextafter(h, np.float16(np.inf)), h)


def _f16_bytes(d: np.ndarray) -> np.ndarray:  # d: [n] -> uint8 [n, 2]
    return d.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _ceil_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ceil(a / b) as integers; 0 where b is 0 (a is then 0 too)."""
    b = b.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, np.ceil(a / b), 0).astype(np.int64)


def _round_div(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """x [n, subs, size] / step [n, subs], rounded to integers; 0 where step is 0."""
    step = step[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(step > 0, np.rint(x / step), 0).astype(np.int64)


# --- Error bounds: blocks float64 [n, block_size] -> bound per block [n].


def _f16_error(x: np.ndarray) -> np.ndarray:
    """Half a float16 unit at |x| (2**-25 is half the subnormal spacing)."""
    return np.abs(x) * 2**-11 + 2**-25


def _f16_bound(blocks: np.ndarray) -> np.ndarray:
    return _f16_error(blocks[:, 0])


def _bf16_bound(blocks: np.ndarray) -> np.ndarray:  # 8 significant bits
    return np.abs(blocks[:, 0]) * 2**-8


def _q8_0_bound(blocks: np.ndarray) -> np.ndarray:
    # q = round(x / d), |q| <= 127, d = absmax / 127 stored as f16
    d = np.abs(blocks).max(axis=1) / 127
    return d / 2 + 127 * _f16_error(d)


def _q_0_bound(blocks: np.ndarray, half_levels: int) -> np.ndarray:
    # Q4_0 / Q5_0: d = -extreme / half_levels; a value of the other sign near absmax maps to
    # +half_levels, one past the top level, so it clips by up to a whole step
    d = np.abs(blocks).max(axis=1) / half_levels
    return d + half_levels * _f16_error(d)


def _q_1_bound(blocks: np.ndarray, top: int) -> np.ndarray:
    # Q4_1 / Q5_1: value = d * q + m, q in 0..top, d = (max - min) / top and m = min in f16
    low = blocks.min(axis=1)
    d = (blocks.max(axis=1) - low) / top
    return d / 2 + top * _f16_error(d) + _f16_error(low)


def _f16_up_error(x: np.ndarray) -> np.ndarray:
    """How much `_f16_up` can add to x: one float16 unit at x."""
    return np.abs(x) * 2**-10 + 2**-24


def _k_bound(
    blocks: np.ndarray, sub_block: int, levels: int, scale_max: int, has_min: bool
) -> np.ndarray:
    # The coarsest sub-block step the quantizers above need (for the types with a min, its
    # offset overshoots the sub-block's low end by less than one dmin), plus less than one unit
    # d of the super-block scale from rounding the step up to a multiple; error <= half of that.
    x = blocks.reshape(blocks.shape[0], -1, sub_block)  # [n, subs, sub_block]
    if has_min:
        low = np.minimum(x.min(axis=2), 0)  # [n, subs]
        dmin = -low.min(axis=1) / scale_max
        dmin += _f16_up_error(dmin)
        needed = ((x.max(axis=2) - low).max(axis=1) + dmin) / (levels - 1)
    else:
        needed = np.abs(x).max(axis=(1, 2)) / (levels / 2 - 0.5)
    d = needed / scale_max
    return (needed + d + _f16_up_error(d)) / 2


_BOUNDS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.F16: _f16_bound,
    T.BF16: _bf16_bound,
    T.Q8_0: _q8_0_bound,
    T.Q4_0: partial(_q_0_bound, half_levels=8),
    T.Q5_0: partial(_q_0_bound, half_levels=16),
    T.Q4_1: partial(_q_1_bound, top=15),
    T.Q5_1: partial(_q_1_bound, top=31),
    T.Q2_K: partial(_k_bound, sub_block=16, levels=4, scale_max=15, has_min=True),
    T.Q3_K: partial(_k_bound, sub_block=16, levels=8, scale_max=31, has_min=False),
    T.Q4_K: partial(_k_bound, sub_block=32, levels=16, scale_max=63, has_min=True),
    T.Q5_K: partial(_k_bound, sub_block=32, levels=32, scale_max=63, has_min=True),
    T.Q6_K: partial(_k_bound, sub_block=16, levels=64, scale_max=127, has_min=False),
}
