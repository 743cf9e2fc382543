"""The Walsh-Hadamard transform of head rows inside a kernel (`layers.kv_rotation` says why an
fp8 cache stores K rotated by it): butterflies over reshaped views, no matrix in memory."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fwht(x, R: tl.constexpr, N: tl.constexpr):
    """x [R, N] times the unnormalised Sylvester Hadamard matrix of order N (a power of two):
    log2 N stages, each pairing columns i and i + 2^s within blocks of 2^(s+1)."""
    for s in tl.static_range(N.bit_length() - 1):
        y = tl.permute(tl.reshape(x, [R, N // (2 << s), 2, 1 << s]), [0, 1, 3, 2])
        a, b = tl.split(y)  # [R, N / 2^(s+1), 2^s]: the pairs' first and second columns
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, N])
    return x


@triton.jit
def hadamard_halves(x1, x2, R: tl.constexpr, HALF: tl.constexpr):
    """Rows [x1 | x2] ([R, HALF] halves, float32) times the normalised Hadamard matrix of order
    2 HALF, as halves: H_2n [x1; x2] = [H_n (x1 + x2); H_n (x1 - x2)], over sqrt(2 HALF)."""
    norm = 1.0 / tl.sqrt(2.0 * HALF)
    return fwht(x1 + x2, R, HALF) * norm, fwht(x1 - x2, R, HALF) * norm
