"""Integer codes as float32 inside the kernels of `int_gemv` and `int_dot`: packed int4
nibbles (masked in place, as planes, or reshaped into rows) and signed int8 codes, made through
their bits against MAGIC (2^23) rather than by integer-to-float conversions.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC: tl.constexpr = tl.constexpr(0x4B000000)  # 2^23: OR-ing c < 2^23 in gives 2^23 + c


@triton.jit
def _nibble_plane(packed, J: tl.constexpr):
    """Nibble J of each packed int32 as float32 code · 16^E exactly, E = J (J < 5) or J - 3: the
    nibble is masked in place (J >= 5: after one shift by 12), so x must carry 16^-E."""
    if J < 5:
        bits = (packed & (0xF << (4 * J))) | MAGIC
    else:
        bits = ((packed >> 12) & (0xF << (4 * (J - 3)))) | MAGIC
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _plane_weight(J: tl.constexpr):
    """16^-E of `_nibble_plane` J (an exact power of two)."""
    if J < 5:
        return 1.0 / (1 << (4 * J))
    else:
        return 1.0 / (1 << (4 * (J - 3)))


@triton.jit
def _shifted_plane(packed, J: tl.constexpr):
    """Nibble J of each packed int32 as float32 code (0..15)."""
    bits = ((packed >> (4 * J)) & 0xF) | MAGIC
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _int8_codes(codes):
    """int8 codes as float32 (2^23 + 128 + code, minus 2^23 + 128)."""
    bits = codes.to(tl.int32) + (MAGIC + 128)
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _load_codes(
    qweight_ptr, k0, offs_n, n_mask, N,
    CODES: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Codes of weight rows k0 .. k0 + BLOCK_K in natural order, float32 [BLOCK_K, BLOCK_N]
    (int4: the 8 nibbles of each packed row reshaped into rows)."""
    if CODES == "int4":  # int32 [K // 8, N]: row k in bits 4 * (k % 8) of packed row k // 8
        rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(
            qweight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=n_mask[None, :]
        )
        nibbles = (packed[:, None, :] >> (4 * tl.arange(0, 8))[None, :, None]) & 0xF
        bits = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)) | MAGIC
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    else:  # int8 [K, N]
        rows = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(
            qweight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=n_mask[None, :]
        )
        return _int8_codes(codes)
