"""The one-row int4 GEMV in float16 pairs (plan kernel "half2"): two codes per instruction.

The lean GEMV (`int_gemv_lean`) issues one LOP3 and one FFMA per code, and Nsight Compute found
it bound by instruction issue (4.6 instructions per code on the H200, DRAM 36%). Here each
instruction handles two codes, as float16 pairs in one 32-bit register (inline PTX):
- one LOP3 ORs two nibbles of a packed word into the mantissas of the pair (1024, 1024): bits
  0..3 and 16..19 make (1024 + n0, 1024 + n4); bits 4..7 and 20..23 (1024 + 16 n1, 1024 +
  16 n5); the same on the word shifted right by 8 for n2, n6 and n3, n7 (one SHF per word);
- one HSUB2 (or HFMA2 by 1/16 minus 64) leaves the two codes, exactly;
- one HFMA2 adds code times x to a float16 pair of partial sums (x as pairs, (x_j, x_j+4)).
13 instructions per word of 8 codes, against ~30 for the lean GEMV. The float16 partial sums
hold one group's codes of one 8-row word column at most (BLOCK_K // 8 words per step, summed in
float32 at the group's end with the scale; offsets multiply the group's Σx in float32), so they
add up at most group_size / 8 products each. x enters float16 divided by 2^X_SHIFT (exact in
float32; the group's sum is multiplied back), so activations up to ~2^X_SHIFT · 65504 / 15 /
(group_size / 8) stay finite.
The interpreter runs no inline PTX: this kernel runs on a GPU only (the sweep checks it against
the float reference there; `bench.kernel_asm` compiles it for sm_90 on a CPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet_engine.kernels.int_gemv_lean import _group_ends
from kvfleet_engine.kernels.pdl import _start
from kvfleet_engine.kernels.split_k import _finish

X_SHIFT = tl.constexpr(4)  # x enters float16 as x / 16

# Two float16 1024.0: the magic of the LOP3 and what HSUB2 takes off; 1/16 and -64 undo the
# x16 of the upper nibble of each byte (1024 + 16 n) / 16 - 64 = n.
_WORD_STEP = tl.constexpr("""{
.reg .b32 t, h, m, c16, c64;
mov.b32 m, 0x64006400;
mov.b32 c16, 0x2c002c00;
mov.b32 c64, 0xd400d400;
lop3.b32 h, $1, 0x000f000f, m, 0xea;
sub.f16x2 h, h, m;
fma.rn.f16x2 $0, h, $2, $6;
lop3.b32 h, $1, 0x00f000f0, m, 0xea;
fma.rn.f16x2 h, h, c16, c64;
fma.rn.f16x2 $0, h, $3, $0;
shr.u32 t, $1, 8;
lop3.b32 h, t, 0x000f000f, m, 0xea;
sub.f16x2 h, h, m;
fma.rn.f16x2 $0, h, $4, $0;
lop3.b32 h, t, 0x00f000f0, m, 0xea;
fma.rn.f16x2 h, h, c16, c64;
fma.rn.f16x2 $0, h, $5, $0;
}""")


@triton.jit
def _word_step(packed, x01, x23, x45, x67, acc):
    """acc + the word's 8 codes times x, as float16 pairs: pair lanes (low, high) hold codes
    (0, 4), (1, 5), (2, 6), (3, 7) against x pairs x01 = (x0, x4), x23 = (x1, x5), ..."""
    return tl.inline_asm_elementwise(
        _WORD_STEP, "=r,r,r,r,r,r,r", [packed, x01, x23, x45, x67, acc],
        dtype=tl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _pair(low, high):
    """Two float32 as a float16 pair (low, high) in one int32."""
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [low, high],
        dtype=tl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _pair_sum(acc):
    """The two float16 lanes of an int32, summed in float32."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .f32 a, b; mov.b32 {lo, hi}, $1; cvt.f32.f16 a, lo; "
        "cvt.f32.f16 b, hi; add.f32 $0, a, b; }",
        "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit(do_not_specialize=["steps_per_split", "split_k"])
def _gemv_half2_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, out_ptr, partial_ptr, counter_ptr,
    N, K, group_size, steps_per_split, split_k,
    HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr, STAGES: tl.constexpr, LAST_REDUCES: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """x [1, K] @ W (int4, int32 [K // 8, N]) for BLOCK_N columns over one of split_k slices
    of K; tiles of [BLOCK_K // 8 packed rows, BLOCK_N columns]. GROUPS: "step" (BLOCK_K ==
    group_size), "all" (one group of K) or "any"."""
    _start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    ROWS: tl.constexpr = BLOCK_K // 8
    offs_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = offs_c < N
    offs_r = tl.arange(0, ROWS)
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + steps_per_split * BLOCK_K)
    down = 1.0 / (1 << X_SHIFT)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    part = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)  # float16 pairs: the group's Σ code · x
    xs = tl.zeros((ROWS, 1), dtype=tl.float32)  # offsets: the group's Σ x
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        words = (k0 // 8 + offs_r)[:, None].to(tl.int64) * N + offs_c[None, :]
        packed = tl.load(  # [ROWS, BLOCK_N], read once: evicted first
            qweight_ptr + words, mask=c_mask[None, :], other=0, eviction_policy="evict_first"
        )
        rows_x = x_ptr + k0 + 8 * offs_r  # row r's 8 inputs: k0 + 8 r + j
        x0 = tl.load(rows_x + 0).to(tl.float32)
        x1 = tl.load(rows_x + 1).to(tl.float32)
        x2 = tl.load(rows_x + 2).to(tl.float32)
        x3 = tl.load(rows_x + 3).to(tl.float32)
        x4 = tl.load(rows_x + 4).to(tl.float32)
        x5 = tl.load(rows_x + 5).to(tl.float32)
        x6 = tl.load(rows_x + 6).to(tl.float32)
        x7 = tl.load(rows_x + 7).to(tl.float32)
        if HAS_OFFSETS:
            xs += (x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7)[:, None]
        x04 = tl.broadcast_to(_pair(x0 * down, x4 * down)[:, None], (ROWS, BLOCK_N))
        x15 = tl.broadcast_to(_pair(x1 * down, x5 * down)[:, None], (ROWS, BLOCK_N))
        x26 = tl.broadcast_to(_pair(x2 * down, x6 * down)[:, None], (ROWS, BLOCK_N))
        x37 = tl.broadcast_to(_pair(x3 * down, x7 * down)[:, None], (ROWS, BLOCK_N))
        part = _word_step(packed, x04, x15, x26, x37, part)
        if _group_ends(k0, k_end, group_size, BLOCK_K, GROUPS):
            group = (k0 // group_size) * N
            scale = tl.load(scales_ptr + group + offs_c, mask=c_mask).to(tl.float32)
            summed = tl.sum(_pair_sum(part), axis=0) * (1 << X_SHIFT)  # [BLOCK_N]
            acc += summed * scale
            if HAS_OFFSETS:
                offset = tl.load(offsets_ptr + group + offs_c, mask=c_mask).to(tl.float32)
                acc += tl.sum(xs, axis=0) * offset
            part = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
            xs = tl.zeros((ROWS, 1), dtype=tl.float32)
    _finish(
        acc[None, :], out_ptr, partial_ptr, counter_ptr, pid_n, pid_k, split_k, tl.arange(0, 1),
        offs_c, 1, N, LAST_REDUCES,
    )  # fmt: skip
