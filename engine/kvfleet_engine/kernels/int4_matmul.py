"""Products with integer weights, dequantized inside the kernel: x [M, K] @ W [K, N] where
W = code * scale + offset per group of `group_size` rows (the layouts of `quant.layout`).

int4 is the general case (packed unsigned codes with scales and offsets); int8 runs the same
kernels with 8-bit signed codes and no offsets (`int8_matmul`). Kernels by shape class:
- GEMV (decode, one row of x): FMAs on the CUDA cores, bound by instruction issue and load
  latency rather than bytes, so each weight costs one LOP3 (its code masked in place into the
  mantissa of 2^23), one FADD (minus 2^23) and one FFMA per row of x, and weight loads may be
  software-pipelined (cp.async a few steps ahead). Each program owns BLOCK_N columns and one of
  SPLIT_K slices of K; the group's x·code products accumulate unscaled in a [rows, columns]
  register tile per row of x (int4: up to 4 rows share the unpacked codes), scales multiply
  that tile once per group, offsets multiply the group's Σx, and a single reduction over rows
  ends the program. A 3-D form takes other row counts.
- dot (decode batches and prompts): tiles of codes into tl.dot on the tensor cores, int4 codes
  as 8 planes of one nibble each (x gathered to match, no reshape) or reshaped; scales on the
  group's fp32 product or on the weights before the dot; with 16-bit x, plane codes may enter
  as code + bias built from their bits alone (no float ops), the bias taken out with Σx.
- dequantize + cuBLAS (long prompts): the weight is expanded once into x's dtype; at thousands of
  rows the product is compute-bound and the expansion is a few percent of it.
Split-K partials are summed by the last program of each output tile (a counter, deterministic
order) or by a second kernel. Codes become floats through their bits, not through integer-to-float
conversions, which issue at a fraction of the FMA rate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import FLOAT_DTYPES, dot_precision, next_power_of_2, require

# The shape tables below follow bench.quant_gemv's sweeps on the H200 (Llama-3.1-8B products).
GEMV_MAX_ROWS = 1  # up to this many rows the GEMV (2 rows and more: the split-K dot was faster)
ROW_GEMV_MAX_ROWS = 4  # the 2-D GEMV takes up to this many rows of x (int4; int8 one)
DOT_MAX_SPLIT_ROWS = 16  # up to this many rows the dot kernel splits K (decode batches)
DEQUANTIZE_MIN_ROWS = 17  # from this many rows, dequantize once and use cuBLAS (the dot tiles
# read the weight once but measured 2x to 5x slower at 64 and 256 rows)
WIDE_N = 16384  # outputs from which a product counts as wide (gate_up) in the tables
LONG_K = 8192  # inputs from which a product counts as long (down)
KERNELS = ("gemv", "dot", "dequantize")
SPLIT_REDUCE = ("last", "kernel")  # who sums split-K partials: the last program, or a kernel
MAGIC: tl.constexpr = tl.constexpr(0x4B000000)  # 2^23: OR-ing c < 2^23 in gives 2^23 + c
COUNTERS = 1 << 16  # split-K counters per device (one per output tile)
# x dtype -> (bias, its bits): code | bits is code + bias exactly (the ulp at the bias is 1)
CODE_BIAS = {torch.bfloat16: (128.0, 0x4300), torch.float16: (1024.0, 0x6400)}


@dataclass(frozen=True)
class MatmulPlan:
    kernel: str  # one of KERNELS
    block_m: int  # rows of x per program (gemv: all of them, a power of two)
    block_n: int  # output columns per program
    block_k: int  # rows of the weight per loop step; a power of two dividing group_size
    split_k: int = 1  # gemv / dot: slices of K, summed as split_reduce says
    split_reduce: str = "last"  # one of SPLIT_REDUCE
    int4_planes: bool = True  # dot: int4 as 8 nibble planes (else unpacked by a reshape)
    scale_after_dot: bool = True  # dot: scales on the group's product (else on the weights)
    biased_codes: bool = False  # dot, int4 planes, scales after the dot, 16-bit x: codes + bias
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs of work, so split-K is exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """int32 [COUNTERS], zero between calls: each split-K tile's last program resets its own."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def split_for(n_blocks: int, k_steps: int, device: torch.device, per_sm: int = 4) -> int:
    """Slices of K that give about `per_sm` programs per SM (at least 2 steps per slice)."""
    wanted = max(1, per_sm * _num_sms(device) // max(1, n_blocks))
    return max(1, min(wanted, k_steps // 2))


def row_gemv_blocks(codes: str, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K before the group's cap, warps, programs per SM) of the one-row GEMV,
    the fastest measured per product class."""
    if codes == "int8":
        return (256, 16, 4, 8) if n >= WIDE_N else (128, 64, 4, 4)
    if n >= WIDE_N:
        return 128, 64, 4, 8
    if k >= LONG_K:
        return 64, 128, 2, 8
    return 256, 128, 4, 8


def plan_matmul(
    m: int, n: int, k: int, group_size: int, device: torch.device, codes: str = "int4"
) -> MatmulPlan:
    """Block sizes by shape class and codes ("int4" or "int8"): a fixed table, so nothing is
    tuned inside graph capture."""
    pow2_of_group = group_size & -group_size  # the largest power of two dividing group_size
    if m <= GEMV_MAX_ROWS:
        block_n, block_k, warps, per_sm = row_gemv_blocks(codes, n, k)
        block_k = min(block_k, pow2_of_group)
        split = split_for(triton.cdiv(n, block_n), k // block_k, device, per_sm)
        return MatmulPlan(
            "gemv", next_power_of_2(m), block_n, block_k, split, num_warps=warps, num_stages=1
        )
    if m >= DEQUANTIZE_MIN_ROWS or pow2_of_group < 16:  # tl.dot needs K tiles of >= 16
        return MatmulPlan("dequantize", 0, 128, min(64, pow2_of_group))
    block_k = min(128 if codes == "int4" else 64, pow2_of_group)
    planes = block_k >= 128  # 8 planes of >= 16 packed rows each
    block_n = 256 if codes == "int4" and n >= WIDE_N else 128
    split = split_for(triton.cdiv(n, block_n), k // block_k, device)
    return MatmulPlan("dot", 16, block_n, block_k, split, int4_planes=planes)


# ---- codes -------------------------------------------------------------------------------------


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


# ---- split-K -----------------------------------------------------------------------------------


@triton.jit
def _finish(
    acc, out_ptr, partial_ptr, counter_ptr, tile, pid_k, split_k, offs_m, offs_n, M, N,
    LAST_REDUCES: tl.constexpr,
):  # fmt: skip
    """Store a program's [BLOCK_M, BLOCK_N] float32 result: the output itself without split-K;
    else its partial, and (LAST_REDUCES) the tile's last program sums all partials in split
    order into the output and resets the tile's counter."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    rows = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if split_k == 1:
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + pid_k * M * N + rows, acc, mask=mask)
        if LAST_REDUCES:
            tl.debug_barrier()  # every thread's partial is written before the release below
            done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == split_k - 1:
                total = tl.zeros_like(acc)
                for split in range(split_k):
                    total += tl.load(
                        partial_ptr + split * M * N + rows, mask=mask, other=0.0,
                        cache_modifier=".cg",
                    )  # fmt: skip
                tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(counter_ptr + tile, 0)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, numel, split_k, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(split_k):
        acc += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- GEMV (CUDA cores) -------------------------------------------------------------------------


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
    STAGES: tl.constexpr, LAST_REDUCES: tl.constexpr,
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


# ---- dot (tensor cores) ------------------------------------------------------------------------


@triton.jit(do_not_specialize=["steps_per_split", "split_k", "code_bits"])
def _dot_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, stride_xm, group_size, steps_per_split, split_k, code_bits,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PLANES: tl.constexpr,
    SCALE_AFTER_DOT: tl.constexpr, CODE_BIAS: tl.constexpr, LAST_REDUCES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """CODE_BIAS (int4 planes, scales after the dot, 16-bit x; else 0): each code enters the dot
    as code + CODE_BIAS in x's dtype, made from its bits alone (code | code_bits, the bits of
    CODE_BIAS: 0x4300 = 128 in bfloat16, 0x6400 = 1024 in float16; exact, one LOP3 after the
    shift and no float ops), and the group's CODE_BIAS · Σx comes off with the offsets."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_pid_n)) * GROUP_M  # GROUP_M row blocks share weight tiles
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * num_pid_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    dtype = x_ptr.dtype.element_ty
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + steps_per_split * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SCALE_AFTER_DOT: the group's x @ code
    x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # SCALE_AFTER_DOT: the group's Σ x
    for k0 in range(k_start, k_end, BLOCK_K):
        group = (k0 // group_size) * N
        scale = tl.load(scales_ptr + group + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_OFFSETS:
            offset = tl.load(offsets_ptr + group + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SCALE_AFTER_DOT:
            x_all = tl.load(
                x_rows + k0 + tl.arange(0, BLOCK_K)[None, :], mask=m_mask[:, None], other=0.0
            )
            x_sum += tl.sum(x_all.to(tl.float32), axis=1)
        if PLANES:  # int4: plane j holds rows k0 + 8 r + j
            offs_r = tl.arange(0, BLOCK_K // 8)
            packed = tl.load(
                qweight_ptr + (k0 // 8 + offs_r)[:, None].to(tl.int64) * N + offs_n[None, :],
                mask=n_mask[None, :],
                other=0,
            )
            for j in tl.static_range(8):
                x_j = tl.load(x_rows + k0 + 8 * offs_r[None, :] + j, mask=m_mask[:, None])
                if CODE_BIAS != 0:
                    bits = ((packed >> (4 * j)) & 0xF) | code_bits
                    codes16 = bits.to(tl.int16).to(dtype, bitcast=True)  # code + CODE_BIAS
                    part = tl.dot(x_j, codes16, part, input_precision=DOT_PRECISION)
                elif SCALE_AFTER_DOT:
                    codes = _shifted_plane(packed, j)
                    part = tl.dot(x_j, codes.to(dtype), part, input_precision=DOT_PRECISION)
                else:
                    weight = _shifted_plane(packed, j) * scale[None, :]
                    if HAS_OFFSETS:
                        weight += offset[None, :]
                    acc = tl.dot(x_j, weight.to(dtype), acc, input_precision=DOT_PRECISION)
        else:
            codes = _load_codes(qweight_ptr, k0, offs_n, n_mask, N, CODES, BLOCK_K, BLOCK_N)
            x = tl.load(
                x_rows + k0 + tl.arange(0, BLOCK_K)[None, :], mask=m_mask[:, None], other=0.0
            )
            if SCALE_AFTER_DOT:
                part = tl.dot(x, codes.to(dtype), part, input_precision=DOT_PRECISION)
            else:
                weight = codes * scale[None, :]
                if HAS_OFFSETS:
                    weight += offset[None, :]
                acc = tl.dot(x, weight.to(dtype), acc, input_precision=DOT_PRECISION)
        if SCALE_AFTER_DOT:
            if ((k0 + BLOCK_K) % group_size == 0) | (k0 + BLOCK_K >= k_end):  # the group ends
                acc += part * scale[None, :]
                if HAS_OFFSETS:
                    acc += x_sum[:, None] * offset[None, :]
                if CODE_BIAS != 0:
                    acc -= x_sum[:, None] * (CODE_BIAS * scale)[None, :]
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    tile = pid_m * num_pid_n + pid_n
    _finish(
        acc, out_ptr, partial_ptr, counter_ptr, tile, pid_k, split_k, offs_m, offs_n, M, N,
        LAST_REDUCES,
    )  # fmt: skip


# ---- dequantize + cuBLAS -----------------------------------------------------------------------


@triton.jit
def _dequantize_kernel(
    qweight_ptr, scales_ptr, offsets_ptr, weight_ptr, N, group_size,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    codes = _load_codes(qweight_ptr, k0, offs_n, n_mask, N, CODES, BLOCK_K, BLOCK_N)
    group = (k0 // group_size) * N
    scale = tl.load(scales_ptr + group + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    weight = codes * scale[None, :]
    if HAS_OFFSETS:
        offset = tl.load(offsets_ptr + group + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        weight += offset[None, :]
    rows = k0 + tl.arange(0, BLOCK_K)
    out = weight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, weight.to(weight_ptr.dtype.element_ty), mask=n_mask[None, :])


# ---- wrappers ----------------------------------------------------------------------------------


def check_operands(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, pack: int
) -> tuple[int, int, int]:
    """x [M, K] float, qweight [K // pack, N], scales [K // group_size, N]; returns M, N, K."""
    require(x.dim() == 2, f"x must be [M, K], got shape {tuple(x.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    require(x.stride(-1) == 1, "x must be contiguous in its last dimension")
    m, k = x.shape
    require(qweight.dim() == 2, f"qweight must be [K // {pack}, N], got {tuple(qweight.shape)}")
    n = qweight.shape[1]
    require(qweight.shape[0] * pack == k, f"qweight must be [{k} // {pack}, N] for x [M, {k}]")
    require(
        isinstance(group_size, int)
        and group_size > 0
        and k % group_size == 0
        and group_size % 8 == 0,
        f"group_size must be a multiple of 8 that divides K ({k}), got {group_size}",
    )
    require(
        scales.shape == (k // group_size, n),
        f"scales must be [K // group_size, N] = [{k // group_size}, {n}], got {list(scales.shape)}",
    )
    require(scales.dtype in FLOAT_DTYPES, f"scales dtype must be one of {FLOAT_DTYPES}")
    for name, tensor in (("qweight", qweight), ("scales", scales)):
        require(tensor.device == x.device, f"{name} must be on the device of x ({x.device})")
        require(tensor.is_contiguous(), f"{name} must be contiguous")
    return m, n, k


def row_gemv_fits(codes: str, m: int, n: int, block_m: int) -> bool:
    """Whether the 2-D GEMV takes these rows: int4 up to 4 (BLOCK_M 1, 2 or 4), int8 one row of
    whole int32 words (N a multiple of 4); others run the 3-D GEMV."""
    if codes == "int4":
        return m <= block_m <= ROW_GEMV_MAX_ROWS
    return m == 1 and block_m == 1 and n % 4 == 0


def split_k_buffers(
    split_k: int, m: int, n: int, device: torch.device
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(split_k, float32 partials [split_k, M, N] or a stand-in, the split-K counters)."""
    partial = torch.empty(split_k if split_k > 1 else 1, m if split_k > 1 else 1, n, device=device)
    return split_k, partial, _counters(device)


def launch(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int4: int32 [K // 8, N]; int8: int8 [K, N]
    scales: torch.Tensor,  # [K // group_size, N]
    offsets: torch.Tensor | None,  # [K // group_size, N] (int4) or None
    group_size: int,
    plan: MatmulPlan,
) -> torch.Tensor:
    """Run one plan on checked operands; returns [M, N] in x's dtype."""
    codes = "int8" if qweight.dtype == torch.int8 else "int4"
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)  # [M, N]
    if m == 0:
        return out
    offsets_arg = scales if offsets is None else offsets  # not read without offsets
    common = dict(CODES=codes, HAS_OFFSETS=offsets is not None, BLOCK_K=plan.block_k)
    if plan.kernel == "dequantize":
        weight = torch.empty(k, n, device=x.device, dtype=x.dtype)  # [K, N]
        _dequantize_kernel[(k // plan.block_k, triton.cdiv(n, plan.block_n))](
            qweight, scales, offsets_arg, weight, n, group_size, BLOCK_N=plan.block_n, **common
        )
        return torch.matmul(x, weight, out=out)
    steps = triton.cdiv(k // plan.block_k, plan.split_k)
    split_k = triton.cdiv(k // plan.block_k, steps)  # no empty slices
    n_blocks = triton.cdiv(n, plan.block_n)
    m_blocks = 1 if plan.kernel == "gemv" else triton.cdiv(m, plan.block_m)
    require(m_blocks * n_blocks <= COUNTERS, f"at most {COUNTERS} output tiles per product")
    last_reduces = plan.split_reduce == "last"
    split_k, partial, counters = split_k_buffers(split_k, m, n, x.device)
    args = (
        x, qweight, scales, offsets_arg, out, partial, counters,
        m, n, k, x.stride(0), group_size, steps, split_k,
    )  # fmt: skip
    if plan.kernel == "gemv" and row_gemv_fits(codes, m, n, plan.block_m):
        words = qweight if codes == "int4" else qweight.view(torch.int32)  # int8: [K, N // 4]
        groups = "step" if group_size == plan.block_k else "all" if group_size == k else "any"
        _gemv_row_kernel[(n_blocks, split_k)](
            x, words, scales, offsets_arg, out, partial, counters, m, n, k, x.stride(0),
            group_size, steps, split_k, MAGIC.value, MAGIC.value | 0x80, MAGIC.value | 0x8000,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, GROUPS=groups, STAGES=plan.num_stages,
            LAST_REDUCES=last_reduces, num_warps=plan.num_warps, num_stages=plan.num_stages,
            **common,
        )  # fmt: skip
    elif plan.kernel == "gemv":
        _gemv_kernel[(n_blocks, split_k)](
            *args, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, LAST_REDUCES=last_reduces,
            num_warps=plan.num_warps, num_stages=plan.num_stages, **common,
        )  # fmt: skip
    else:
        planes = plan.int4_planes and codes == "int4"
        biased = plan.biased_codes and planes and plan.scale_after_dot and x.dtype in CODE_BIAS
        bias, bias_bits = CODE_BIAS[x.dtype] if biased else (0.0, 0)
        _dot_kernel[(m_blocks * n_blocks, split_k)](
            *args, bias_bits, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, GROUP_M=8,
            PLANES=planes, SCALE_AFTER_DOT=plan.scale_after_dot, CODE_BIAS=bias,
            LAST_REDUCES=last_reduces, DOT_PRECISION=dot_precision(x.dtype),
            num_warps=plan.num_warps, num_stages=plan.num_stages, **common,
        )  # fmt: skip
    if split_k > 1 and not last_reduces:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](partial, out, m * n, split_k, BLOCK=block)
    return out


def int4_matmul(
    x: torch.Tensor,  # [M, K], already gathered by the act-order perm
    qweight: torch.Tensor,  # int32 [K // 8, N]
    scales: torch.Tensor,  # [K // group_size, N]
    offsets: torch.Tensor,  # [K // group_size, N], the dtype of scales
    group_size: int,
) -> torch.Tensor:
    """x @ (code * scale + offset) -> [M, N] in x's dtype (bias is the caller's)."""
    m, n, k = check_operands(x, qweight, scales, group_size, pack=8)
    require(
        qweight.dtype == torch.int32, f"qweight must be int32 (8 codes each), got {qweight.dtype}"
    )
    require(
        offsets.shape == scales.shape and offsets.dtype == scales.dtype,
        f"offsets must have the shape and dtype of scales ({tuple(scales.shape)}, {scales.dtype})",
    )
    require(offsets.device == x.device, f"offsets must be on the device of x ({x.device})")
    require(offsets.is_contiguous(), "offsets must be contiguous")
    return launch(
        x, qweight, scales, offsets, group_size, plan_matmul(m, n, k, group_size, x.device)
    )
