"""The one-row integer-weight GEMV with two instructions per code (plan kernel "lean"): each code
becomes a float32 by one mask-and-OR into the bits of a power of two (or, int8 on the GPU, one
PRMT), and goes straight into one FFMA with x: no FADD taking the magic number off per code and
no scaling of x per code position.

A field of bits b .. b + w - 1 (b + w <= 23) OR-ed into the bits of 2^(23 - b) reads as
2^(23 - b) + n exactly, so x times it is x · n + x · 2^(23 - b): the bias term does not depend
on the column, so it is summed once per row of the weight tile (xb) and taken off each group's
sum before the scale. Fields sit at b >= 8, so the bias is at most 2^15 and float32 accumulation
keeps the error near 3e-4 relative (bfloat16 output rounding is ~2e-3).
- int4 (int32 [K // 8, N], nibble j at bits 4 j): nibbles 2, 3, 4 in place (b = 8, 12, 16),
  0, 1 after one shift left by 8, 5, 6, 7 after one shift right by 12 (2 SHF + 8 LOP3 + 8 FFMA
  per word, against 1 SHF + 8 LOP3 + 8 FADD + 8 FFMA in `int_gemv`).
- int8 (int32 words of 4 columns): the word XOR 0x80808080 (signed -> code + 128) once, then
  each byte placed at bits 8 .. 15 of 2^15: one PRMT on the GPU (inline PTX), a shift and a
  mask under the interpreter (PRMT is not interpreted; the GPU sweep checks that path against
  the reference, the CPU tests the integer one).
The three powers of two come at run time (in registers, (bits & mask) | magic is one LOP3).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet_engine.kernels.int_plan import INTERPRETED
from kvfleet_engine.kernels.pdl import _start
from kvfleet_engine.kernels.split_k import _finish

MAGICS = (0x47000000, 0x45000000, 0x43000000)  # float32 2^15, 2^11, 2^7: fields at b = 8, 12, 16
INT8_FLIP = -0x7F7F7F80  # 0x80808080 as int32: flips each byte's sign bit (code + 128)
INT8_BIAS: tl.constexpr = tl.constexpr(32768.0 + 128.0)  # 2^15 + the flip's 128, per byte
PRMT = not INTERPRETED  # the interpreter runs no inline PTX


@triton.jit
def _pick(J: tl.constexpr, m8, m12, m16):
    """The magic of field position P = 0, 1, 2 (b = 8, 12, 16)."""
    if J == 0:
        out = m8
    elif J == 1:
        out = m12
    else:
        out = m16
    return out


@triton.jit
def _nibble(packed, low, high, J: tl.constexpr, m8, m12, m16):
    """Nibble J of int32 words as float32 2^(23 - b) + code (b = 8, 12 or 16), exactly."""
    if J < 2:
        bits = (low & (0xF << (8 + 4 * J))) | _pick(J, m8, m12, m16)
    elif J < 5:
        bits = (packed & (0xF << (8 + 4 * (J - 2)))) | _pick(J - 2, m8, m12, m16)
    else:
        bits = (high & (0xF << (8 + 4 * (J - 5)))) | _pick(J - 5, m8, m12, m16)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _nibble_bias(J: tl.constexpr):
    """2^(23 - b) of `_nibble` J."""
    if J < 2:
        out = 1 << (15 - 4 * J)
    elif J < 5:
        out = 1 << (15 - 4 * (J - 2))
    else:
        out = 1 << (15 - 4 * (J - 5))
    return out * 1.0


@triton.jit
def _byte(flipped, BYTE: tl.constexpr, one, USE_PRMT: tl.constexpr):
    """Byte BYTE of int32 words (sign bits already flipped) as float32 2^15 + code + 128."""
    if USE_PRMT:  # result bytes: 0x00 (2^15's byte 0), byte BYTE, 0x00, 0x47 (its bytes 2, 3)
        bits = tl.inline_asm_elementwise(
            "{ .reg .b32 magic; mov.b32 magic, 1191182336; "
            f"prmt.b32 $0, $1, magic, {0x7604 | (BYTE << 4)}; }}",
            "=r,r", [flipped], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    elif BYTE == 0:
        bits = ((flipped << 8) & 0xFF00) | one
    elif BYTE == 1:
        bits = (flipped & 0xFF00) | one
    elif BYTE == 2:
        bits = ((flipped >> 8) & 0xFF00) | one
    else:
        bits = ((flipped >> 16) & 0xFF00) | one
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _group_ends(k0, k_end, group_size, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
    """Whether the step at row k0 ends a group: GROUPS "step" (BLOCK_K == group_size), "all"
    (one group of K) or "any"."""
    if GROUPS == "step":
        ends = True
    elif GROUPS == "all":
        ends = k0 + BLOCK_K >= k_end
    else:
        ends = ((k0 + BLOCK_K) % group_size == 0) | (k0 + BLOCK_K >= k_end)
    return ends


@triton.jit
def _group_end(acc, part, xb, xs, scales_ptr, offsets_ptr, k0, offs, mask, N, group_size,
               BYTE: tl.constexpr, CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr):  # fmt: skip
    """acc + (part - xb) · scale (+ Σx · offset) for the group of row k0 (int8: the scales of
    byte BYTE of each word)."""
    group = (k0 // group_size) * N
    if CODES == "int4":
        scale = tl.load(scales_ptr + group + offs, mask=mask).to(tl.float32)[None, :]
        acc += (part - xb) * scale
        if HAS_OFFSETS:
            offset = tl.load(offsets_ptr + group + offs, mask=mask).to(tl.float32)[None, :]
            acc += xs * offset
    else:
        scale = tl.load(scales_ptr + group + 4 * offs + BYTE, mask=mask).to(tl.float32)
        acc += (part - xb) * scale[None, :]
    return acc


@triton.jit(do_not_specialize=["steps_per_split", "split_k", "m8", "m12", "m16", "flip"])
def _gemv_lean_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, out_ptr, partial_ptr, counter_ptr,
    N, K, group_size, steps_per_split, split_k, m8, m12, m16, flip,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUPS: tl.constexpr, STAGES: tl.constexpr,
    LAST_REDUCES: tl.constexpr, USE_PRMT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """x [1, K] @ W for BLOCK_N columns over one of split_k slices of K. Tiles are [rows of the
    weight, int32 columns] (int4: BLOCK_K // 8 packed rows x BLOCK_N columns; int8: BLOCK_K rows x
    BLOCK_N // 4 words), so each thread keeps the 16-byte vectors it loads. m8, m12, m16 (the
    bits of 2^15, 2^11, 2^7) and flip come at run time: in a register, (bits & mask) | m8 is one
    LOP3. GROUPS: "step"
    (BLOCK_K == group_size), "all" (one group of K) or "any"."""
    _start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    ROWS: tl.constexpr = BLOCK_K // 8 if CODES == "int4" else BLOCK_K
    COLS: tl.constexpr = BLOCK_N if CODES == "int4" else BLOCK_N // 4
    words_per_row = N if CODES == "int4" else N // 4
    offs_c = pid_n * COLS + tl.arange(0, COLS)
    c_mask = offs_c < words_per_row
    offs_r = tl.arange(0, ROWS)
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + steps_per_split * BLOCK_K)
    # Σ_groups scale · (Σ x · field - bias): int4 one tile; int8 one per byte of the words
    acc0 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    acc1 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    acc2 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    acc3 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    part0 = tl.zeros((ROWS, COLS), dtype=tl.float32)  # the group's Σ x · field
    part1 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    part2 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    part3 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    xb = tl.zeros((ROWS, 1), dtype=tl.float32)  # the group's bias: Σ x · 2^(23 - b) (+ 128 x)
    xs = tl.zeros((ROWS, 1), dtype=tl.float32)  # int4 offsets: the group's Σ x
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        row0 = k0 // 8 if CODES == "int4" else k0
        words = (row0 + offs_r)[:, None].to(tl.int64) * words_per_row + offs_c[None, :]
        packed = tl.load(  # [ROWS, COLS], read once: evicted first
            qweight_ptr + words, mask=c_mask[None, :], other=0, eviction_policy="evict_first"
        )
        if CODES == "int4":  # nibble j of packed row r is weight row k0 + 8 r + j
            low = packed << 8
            high = packed >> 12
            for j in tl.static_range(8):
                x_j = tl.load(x_ptr + k0 + 8 * offs_r + j).to(tl.float32)[:, None]  # [ROWS, 1]
                part0 += x_j * _nibble(packed, low, high, j, m8, m12, m16)
                xb += x_j * _nibble_bias(j)
                if HAS_OFFSETS:
                    xs += x_j
        else:  # byte i of word c is column 4 c + i
            x = tl.load(x_ptr + k0 + offs_r).to(tl.float32)[:, None]  # [ROWS, 1]
            flipped = packed ^ flip
            part0 += x * _byte(flipped, 0, m8, USE_PRMT)
            part1 += x * _byte(flipped, 1, m8, USE_PRMT)
            part2 += x * _byte(flipped, 2, m8, USE_PRMT)
            part3 += x * _byte(flipped, 3, m8, USE_PRMT)
            xb += x * INT8_BIAS
        if _group_ends(k0, k_end, group_size, BLOCK_K, GROUPS):
            acc0 = _group_end(acc0, part0, xb, xs, scales_ptr, offsets_ptr, k0, offs_c, c_mask,
                              N, group_size, 0, CODES, HAS_OFFSETS)  # fmt: skip
            part0 = tl.zeros((ROWS, COLS), dtype=tl.float32)
            if CODES == "int8":
                acc1 = _group_end(acc1, part1, xb, xs, scales_ptr, offsets_ptr, k0, offs_c,
                                  c_mask, N, group_size, 1, CODES, HAS_OFFSETS)  # fmt: skip
                acc2 = _group_end(acc2, part2, xb, xs, scales_ptr, offsets_ptr, k0, offs_c,
                                  c_mask, N, group_size, 2, CODES, HAS_OFFSETS)  # fmt: skip
                acc3 = _group_end(acc3, part3, xb, xs, scales_ptr, offsets_ptr, k0, offs_c,
                                  c_mask, N, group_size, 3, CODES, HAS_OFFSETS)  # fmt: skip
                part1 = tl.zeros((ROWS, COLS), dtype=tl.float32)
                part2 = tl.zeros((ROWS, COLS), dtype=tl.float32)
                part3 = tl.zeros((ROWS, COLS), dtype=tl.float32)
            xb = tl.zeros((ROWS, 1), dtype=tl.float32)
            xs = tl.zeros((ROWS, 1), dtype=tl.float32)
    if CODES == "int8":  # [c, t, s] is byte 2 t + s of word c
        even = tl.join(tl.sum(acc0, axis=0), tl.sum(acc2, axis=0))  # [COLS, 2]: bytes 0, 2
        odd = tl.join(tl.sum(acc1, axis=0), tl.sum(acc3, axis=0))  # bytes 1, 3
        out = tl.reshape(tl.join(even, odd), (1, BLOCK_N))
    else:
        out = tl.sum(acc0, axis=0)[None, :]  # [1, BLOCK_N]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _finish(
        out, out_ptr, partial_ptr, counter_ptr, pid_n, pid_k, split_k, tl.arange(0, 1), offs_n,
        1, N, LAST_REDUCES,
    )  # fmt: skip
