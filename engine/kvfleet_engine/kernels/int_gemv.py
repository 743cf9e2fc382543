"""The integer-weight GEMVs on the CUDA cores (decode, few rows of x): the 2-D row kernel
(int4 up to ROW_GEMV_MAX_ROWS rows, int8 one row; `row_gemv_fits` says which rows it takes) and
the 3-D kernel for other row counts, with their group-scaling and code helpers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet_engine.kernels.int_codes import _int8_codes, _nibble_plane, _plane_weight
from kvfleet_engine.kernels.int_plan import ROW_GEMV_MAX_ROWS
from kvfleet_engine.kernels.pdl import _start
from kvfleet_engine.kernels.split_k import _finish


@triton.jit
def _scale_group(
    acc0, acc1, acc2, acc3, step0, step1, step2, step3, xs0, xs1, xs2, xs3, scales_ptr,
    offsets_ptr, k0, offs_c, c_mask, N, group_size, CODES: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """acc_i + step_i · scale (+ Σx_i · offset) for the group of row k0, [rows, columns] tiles
    (int4: i is the row of x; int8: byte i of word c is column 4 c + i)."""
    group = (k0 // group_size) * N
    if CODES == "int4":
        scale = tl.load(scales_ptr + group + offs_c, mask=c_mask).to(tl.float32)[None, :]
        acc0 += step0 * scale
        if BLOCK_M > 1:
            acc1 += step1 * scale
        if BLOCK_M > 2:
            acc2 += step2 * scale
            acc3 += step3 * scale
        if HAS_OFFSETS:
            offset = tl.load(offsets_ptr + group + offs_c, mask=c_mask).to(tl.float32)[None, :]
            acc0 += xs0 * offset
            if BLOCK_M > 1:
                acc1 += xs1 * offset
            if BLOCK_M > 2:
                acc2 += xs2 * offset
                acc3 += xs3 * offset
    else:
        scales = scales_ptr + group + 4 * offs_c
        acc0 += step0 * tl.load(scales, mask=c_mask).to(tl.float32)[None, :]
        acc1 += step1 * tl.load(scales + 1, mask=c_mask).to(tl.float32)[None, :]
        acc2 += step2 * tl.load(scales + 2, mask=c_mask).to(tl.float32)[None, :]
        acc3 += step3 * tl.load(scales + 3, mask=c_mask).to(tl.float32)[None, :]
    return acc0, acc1, acc2, acc3


@triton.jit
def _byte_codes(word, BYTE: tl.constexpr, flip):
    """Byte BYTE (0 or 1) of int32 words holding signed int8 codes: float32 code · 256^BYTE,
    masked in place with the sign bit flipped (flip = MAGIC | 0x80 << 8 BYTE, at run time:
    2^23 + (code + 128) · 256^BYTE, minus the bias)."""
    bits = (word & (0xFF << (8 * BYTE))) ^ flip
    return bits.to(tl.float32, bitcast=True) - (8388608.0 + 128.0 * (1 << (8 * BYTE)))


@triton.jit
def _x_plane(x_ptr, stride_xm, M, offs, ROW: tl.constexpr):
    """float32 [ROWS, 1]: x[ROW, offs] (0 for a row past M)."""
    if ROW == 0:
        x = tl.load(x_ptr + offs)
    else:
        x = tl.load(x_ptr + ROW * stride_xm + offs, mask=(offs * 0 + ROW) < M, other=0.0)
    return x.to(tl.float32)[:, None]


@triton.jit(do_not_specialize=["steps_per_split", "split_k", "magic", "flip0", "flip1"])
def _gemv_row_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, stride_xm, group_size, steps_per_split, split_k, magic, flip0, flip1,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
    STAGES: tl.constexpr, LAST_REDUCES: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """The GEMV of BLOCK_M (int8: 1; int4: 1, 2 or 4) rows of x. Tiles are 2-D [rows, columns],
    so each thread keeps the 16-byte vectors it loads (a tile with a third, row-of-x dimension
    gets one column per thread); each row of x has its own accumulator tiles and shares the
    unpacked codes. int4: packed rows [BLOCK_K // 8, BLOCK_N], nibble j masked in place as
    code · 16^E (x carries 16^-E); int8: int32 words of 4 columns [BLOCK_K, BLOCK_N // 4],
    byte b as code · 256^(b % 2). magic (MAGIC; flip0 / flip1: MAGIC | 0x80 / 0x8000) comes at
    run time: in a register, (bits & mask) ^ magic is one LOP3 (with two immediates it takes
    two). GROUPS: "step" (BLOCK_K == group_size), "all" (one group: the scales multiply the sums
    once, at the end) or "any". STAGES > 1 software-pipelines the weight loads (cp.async into
    shared memory, STAGES - 1 steps ahead), so loads stay in flight while a step computes."""
    _start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    ROWS: tl.constexpr = BLOCK_K // 8 if CODES == "int4" else BLOCK_K  # loaded rows per step
    COLS: tl.constexpr = BLOCK_N if CODES == "int4" else BLOCK_N // 4  # loaded int32 columns
    words_per_row = N if CODES == "int4" else N // 4
    offs_c = pid_n * COLS + tl.arange(0, COLS)  # int4: output columns; int8: words
    c_mask = offs_c < words_per_row
    offs_r = tl.arange(0, ROWS)
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + steps_per_split * BLOCK_K)
    # Σ_groups scale · Σ x·code: int4, one tile per row of x; int8, one per byte of the words
    acc0 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    acc1 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    acc2 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    acc3 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    part0 = tl.zeros((ROWS, COLS), dtype=tl.float32)  # GROUPS "any": the group's Σ x·code
    part1 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    part2 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    part3 = tl.zeros((ROWS, COLS), dtype=tl.float32)
    xs0 = tl.zeros((ROWS, 1), dtype=tl.float32)  # int4 offsets: the group's Σ x per row of x
    xs1 = tl.zeros((ROWS, 1), dtype=tl.float32)
    xs2 = tl.zeros((ROWS, 1), dtype=tl.float32)
    xs3 = tl.zeros((ROWS, 1), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        if CODES == "int4":
            row0 = k0 // 8
        else:
            row0 = k0
        words = (row0 + offs_r)[:, None].to(tl.int64) * words_per_row + offs_c[None, :]
        packed = tl.load(  # [ROWS, COLS], read once: evicted first
            qweight_ptr + words, mask=c_mask[None, :], other=0, eviction_policy="evict_first"
        )
        if GROUPS == "all":  # products go straight into the accumulators
            step0, step1, step2, step3 = acc0, acc1, acc2, acc3
        elif GROUPS == "step":
            step0 = tl.zeros((ROWS, COLS), dtype=tl.float32)
            step1, step2, step3 = step0, step0, step0
        else:
            step0, step1, step2, step3 = part0, part1, part2, part3
        if CODES == "int4":  # plane j: rows k0 + 8 r + j, nibble j masked in place, x · 16^-E
            high = packed >> 12  # nibbles 5..7 at bits 8..19 (a mask at bit 0 would make it a
            # bit-field extract: two instructions)
            for j in tl.static_range(8):
                if j < 5:
                    bits = (packed & (0xF << (4 * j))) ^ magic
                else:
                    bits = (high & (0xF << (4 * (j - 3)))) ^ magic
                codes = bits.to(tl.float32, bitcast=True) - 8388608.0
                offs_x = k0 + 8 * offs_r + j
                x_j = _x_plane(x_ptr, stride_xm, M, offs_x, 0)  # [ROWS, 1]
                step0 += (x_j * _plane_weight(j)) * codes
                if HAS_OFFSETS:
                    xs0 += x_j
                if BLOCK_M > 1:
                    x_j = _x_plane(x_ptr, stride_xm, M, offs_x, 1)
                    step1 += (x_j * _plane_weight(j)) * codes
                    if HAS_OFFSETS:
                        xs1 += x_j
                if BLOCK_M > 2:
                    x_j = _x_plane(x_ptr, stride_xm, M, offs_x, 2)
                    step2 += (x_j * _plane_weight(j)) * codes
                    if HAS_OFFSETS:
                        xs2 += x_j
                    x_j = _x_plane(x_ptr, stride_xm, M, offs_x, 3)
                    step3 += (x_j * _plane_weight(j)) * codes
                    if HAS_OFFSETS:
                        xs3 += x_j
        else:  # bytes 0, 1 in place (code · 1, code · 256); bytes 2, 3 after a shift by 16
            x = tl.load(x_ptr + k0 + offs_r).to(tl.float32)[:, None]  # [ROWS, 1]
            high = packed >> 16
            step0 += x * _byte_codes(packed, 0, flip0)
            step1 += x * _byte_codes(packed, 1, flip1)
            step2 += x * _byte_codes(high, 0, flip0)
            step3 += x * _byte_codes(high, 1, flip1)
        if GROUPS == "all":
            acc0, acc1, acc2, acc3 = step0, step1, step2, step3
        elif GROUPS == "step":
            acc0, acc1, acc2, acc3 = _scale_group(
                acc0, acc1, acc2, acc3, step0, step1, step2, step3, xs0, xs1, xs2, xs3,
                scales_ptr, offsets_ptr, k0, offs_c, c_mask, N, group_size, CODES, HAS_OFFSETS,
                BLOCK_M,
            )  # fmt: skip
            xs0 = tl.zeros((ROWS, 1), dtype=tl.float32)
            xs1, xs2, xs3 = xs0, xs0, xs0
        else:
            if ((k0 + BLOCK_K) % group_size == 0) | (k0 + BLOCK_K >= k_end):  # the group ends
                acc0, acc1, acc2, acc3 = _scale_group(
                    acc0, acc1, acc2, acc3, step0, step1, step2, step3, xs0, xs1, xs2, xs3,
                    scales_ptr, offsets_ptr, k0, offs_c, c_mask, N, group_size, CODES,
                    HAS_OFFSETS, BLOCK_M,
                )  # fmt: skip
                xs0 = tl.zeros((ROWS, 1), dtype=tl.float32)
                xs1, xs2, xs3 = xs0, xs0, xs0
                step0 = tl.zeros((ROWS, COLS), dtype=tl.float32)
                step1, step2, step3 = step0, step0, step0
            part0, part1, part2, part3 = step0, step1, step2, step3
    if GROUPS == "all":  # scale the sums once
        zero = tl.zeros((ROWS, COLS), dtype=tl.float32)
        acc0, acc1, acc2, acc3 = _scale_group(
            zero, zero, zero, zero, acc0, acc1, acc2, acc3, xs0, xs1, xs2, xs3, scales_ptr,
            offsets_ptr, k_start, offs_c, c_mask, N, group_size, CODES, HAS_OFFSETS, BLOCK_M,
        )  # fmt: skip
    if CODES == "int8":  # byte b of word c is column 4 c + b; bytes 1 and 3 carry 256
        even = tl.join(tl.sum(acc0, axis=0), tl.sum(acc2, axis=0))  # [COLS, 2]: bytes 0, 2
        odd = tl.join(tl.sum(acc1, axis=0), tl.sum(acc3, axis=0)) * (1.0 / 256)  # bytes 1, 3
        out = tl.reshape(tl.join(even, odd), (1, BLOCK_N))  # [c, t, s] is byte 2 t + s
    elif BLOCK_M == 1:
        out = tl.sum(acc0, axis=0)[None, :]  # [1, BLOCK_N]
    elif BLOCK_M == 2:
        out = tl.trans(tl.join(tl.sum(acc0, axis=0), tl.sum(acc1, axis=0)))  # [2, BLOCK_N]
    else:  # the joins' [n, i, o] is row 2 i + o, its place once flattened
        inner = tl.join(tl.sum(acc0, axis=0), tl.sum(acc2, axis=0))  # rows 0, 2
        outer = tl.join(tl.sum(acc1, axis=0), tl.sum(acc3, axis=0))  # rows 1, 3
        out = tl.trans(tl.reshape(tl.join(inner, outer), (BLOCK_N, 4)))  # [4, BLOCK_N]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _finish(
        out, out_ptr, partial_ptr, counter_ptr, pid_n, pid_k, split_k, tl.arange(0, BLOCK_M),
        offs_n, M, N, LAST_REDUCES,
    )  # fmt: skip


@triton.jit(do_not_specialize=["steps_per_split", "split_k"])  # one compile for every split
def _gemv_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, stride_xm, group_size, steps_per_split, split_k,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LAST_REDUCES: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + steps_per_split * BLOCK_K)
    ROWS: tl.constexpr = BLOCK_K // 8 if CODES == "int4" else BLOCK_K  # loaded rows per step
    offs_r = tl.arange(0, ROWS)
    acc = tl.zeros((BLOCK_M, ROWS, BLOCK_N), dtype=tl.float32)  # Σ_groups scale · Σ x·code
    part = tl.zeros((BLOCK_M, ROWS, BLOCK_N), dtype=tl.float32)  # this group's Σ x·code
    x_sum = tl.zeros((BLOCK_M, ROWS), dtype=tl.float32)  # this group's Σ x, per loaded row
    for k0 in range(k_start, k_end, BLOCK_K):  # BLOCK_K divides group_size: one group per step
        if CODES == "int4":
            row0 = k0 // 8
        else:
            row0 = k0
        w_rows = (row0 + offs_r)[:, None].to(tl.int64) * N + offs_n[None, :]
        packed = tl.load(qweight_ptr + w_rows, mask=n_mask[None, :], other=0)  # [ROWS, BLOCK_N]
        if CODES == "int4":  # x_j [BLOCK_M, ROWS]: x of rows k0 + 8 r + j
            for j in tl.static_range(8):
                x_j = tl.load(x_rows + k0 + 8 * offs_r[None, :] + j, mask=m_mask[:, None])
                x_j = x_j.to(tl.float32)
                if HAS_OFFSETS:
                    x_sum += x_j
                part += (x_j * _plane_weight(j))[:, :, None] * _nibble_plane(packed, j)[None, :, :]
        else:
            x = tl.load(x_rows + k0 + offs_r[None, :], mask=m_mask[:, None]).to(tl.float32)
            part += x[:, :, None] * _int8_codes(packed)[None, :, :]
        if ((k0 + BLOCK_K) % group_size == 0) | (k0 + BLOCK_K >= k_end):  # the group ends
            group = (k0 // group_size) * N
            scale = tl.load(scales_ptr + group + offs_n, mask=n_mask).to(tl.float32)
            acc += part * scale[None, None, :]
            part = tl.zeros((BLOCK_M, ROWS, BLOCK_N), dtype=tl.float32)
            if HAS_OFFSETS:
                offset = tl.load(offsets_ptr + group + offs_n, mask=n_mask).to(tl.float32)
                acc += x_sum[:, :, None] * offset[None, None, :]
                x_sum = tl.zeros((BLOCK_M, ROWS), dtype=tl.float32)
    out = tl.sum(acc, axis=1)  # [BLOCK_M, BLOCK_N]
    _finish(
        out, out_ptr, partial_ptr, counter_ptr, pid_n, pid_k, split_k, offs_m, offs_n, M, N,
        LAST_REDUCES,
    )  # fmt: skip


def row_gemv_fits(codes: str, m: int, n: int, block_m: int) -> bool:
    """Whether the 2-D GEMV takes these rows: int4 up to 4 (BLOCK_M 1, 2 or 4), int8 one row of
    whole int32 words (N a multiple of 4); others run the 3-D GEMV."""
    if codes == "int4":
        return m <= block_m <= ROW_GEMV_MAX_ROWS
    return m == 1 and block_m == 1 and n % 4 == 0
