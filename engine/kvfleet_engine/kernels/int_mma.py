"""The integer-weight products on the tensor cores with the dequantization fused into the K loop
(W4A16 / W8A16), for every row count: decode (x padded to 16 rows, K split across programs to
fill the SMs) and prompts (tiles of 64-128 rows that read the packed weight once per row block).

Codes enter the dot as code + bias in the dot's 16-bit dtype, made from their bits alone (no
float instructions): a nibble OR-ed into the bits of 128 (bfloat16, 0x4300) or 1024 (float16,
0x6400) is exactly 128 + code / 1024 + code. For int4 one shift and one mask-and-OR make two
codes at once (bits 4j and 16 + 4j of a word: nibbles j and j + 4 of the layout), each half
then read as a 16-bit value. int8 codes (signed, -128..127) need 8 significant bits, which
bfloat16 lacks, so they enter as float16 1024 + 128 + code (the byte XOR-ed with 0x6480) against
x rounded to float16 (clamped at ±65504), or converted (`INT8_CAST`) in x's dtype. Each group's
dot, Σx · code_plus_bias, is then scaled once: acc += part · scale + Σx · (offset - bias · scale).

Variants (constexpr, picked by a plan): UNPACK "planes" (int4, BLOCK_K >= 128: 8 dots per step
of one nibble plane each, x gathered at a stride of 8 to match) or "reshape" (the tile unpacked
into K order, one dot, x loaded contiguously); SWAP_AB computes out^T = W^T x^T, so the weight is
the dot's left operand (M of the MMA is N of the product: no 16-row padding of the weight side);
GROUPS "step" (BLOCK_K == group_size), "all" (one group: scaled once at the end) or "any".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import require
from kvfleet_engine.kernels.split_k import _finish

UNPACKS = ("planes", "reshape")
# dot dtype -> (int4 bias, bits of the bias repeated in both 16-bit halves of a word)
INT4_BIAS = {torch.bfloat16: (128.0, 0x43004300), torch.float16: (1024.0, 0x64006400)}
INT8_BIAS = (1152.0, 0x6480)  # float16: byte ^ 0x6480 = 1024 + (code + 128), for any code


@triton.jit
def _mma(acc, x, w, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + x [BM, kk] @ w [kk, BN] (SWAP_AB: acc^T + w^T @ x^T, acc [BN, BM]). One return
    after an if / else: Triton 3.6's compiler also traces the code after a return inside a
    constexpr if (its interpreter does not), so the other form's dot saw the wrong acc."""
    if SWAP_AB:
        out = tl.dot(tl.trans(w), tl.trans(x), acc, input_precision=DOT_PRECISION)
    else:
        out = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _along_n(v, SWAP_AB: tl.constexpr):
    """A [BLOCK_N] vector broadcast over the accumulator's columns of N."""
    if SWAP_AB:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def _along_m(v, SWAP_AB: tl.constexpr):
    """A [BLOCK_M] vector broadcast over the accumulator's rows of x."""
    if SWAP_AB:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def _x_tile(x_rows, offs_k, m_mask, DOT_DTYPE: tl.constexpr):
    """x [BLOCK_M, len(offs_k)] in the dot's dtype (float16 from bfloat16: clamped at ±65504)."""
    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
    if x.dtype != DOT_DTYPE:
        x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(DOT_DTYPE)
    return x


@triton.jit
def _int4_plane_pair(packed, J: tl.constexpr, pair_bits, DOT_DTYPE: tl.constexpr):
    """Nibbles J and J + 4 (J < 4) of int32 words as the dot's dtype, code + bias each (float32
    codes when the dot is in float32)."""
    if DOT_DTYPE == tl.float32:
        low = ((packed >> (4 * J)) & 0xF).to(tl.float32)
        high = ((packed >> (4 * J + 16)) & 0xF).to(tl.float32)
    else:
        pair = ((packed >> (4 * J)) & 0x000F000F) | pair_bits
        low = pair.to(tl.int16).to(DOT_DTYPE, bitcast=True)
        high = (pair >> 16).to(tl.int16).to(DOT_DTYPE, bitcast=True)
    return low, high


@triton.jit
def _int4_tile(
    packed, pair_bits, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr
):
    """int32 [BLOCK_K // 8, BLOCK_N] -> codes (+ bias) [BLOCK_K, BLOCK_N] in K order."""
    shifts = 4 * tl.arange(0, 8)
    nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K // 8, 8, BLOCK_N]
    if DOT_DTYPE == tl.float32:
        codes = nibbles.to(tl.float32)
    else:
        codes = (nibbles | (pair_bits & 0xFFFF)).to(tl.int16).to(DOT_DTYPE, bitcast=True)
    return tl.reshape(codes, (BLOCK_K, BLOCK_N))


@triton.jit
def _int8_tile(codes, code_bits, DOT_DTYPE: tl.constexpr, INT8_CAST: tl.constexpr):
    """int8 codes as the dot's dtype: cast, or float16 1152 + code from the byte's bits."""
    if INT8_CAST:  # one return after if / else (see _mma)
        out = codes.to(DOT_DTYPE)
    else:
        bits = codes.to(tl.uint8, bitcast=True).to(tl.int32) ^ code_bits
        out = bits.to(tl.int16).to(tl.float16, bitcast=True)
    return out


@triton.jit(do_not_specialize=["steps_per_split", "split_k", "code_bits"])
def _mma_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, stride_xm, group_size, steps_per_split, split_k, code_bits,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UNPACK: tl.constexpr,
    SWAP_AB: tl.constexpr, GROUPS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    CODE_BIAS: tl.constexpr, INT8_CAST: tl.constexpr, LAST_REDUCES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] output tile over one of split_k slices of K. code_bits: int4, the
    bias's 16 bits in both halves (0x43004300 / 0x64006400); int8, 0x6480 (at run time: in a
    register, the mask-and-OR is one LOP3)."""
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
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + steps_per_split * BLOCK_K)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros_like(acc)  # the group's x @ (code + bias)
    x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # the group's Σx (offsets, bias)
    for k0 in range(k_start, k_end, BLOCK_K):
        if CODES == "int4":
            offs_r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(  # [BLOCK_K // 8, BLOCK_N]
                qweight_ptr + offs_r[:, None].to(tl.int64) * N + offs_n[None, :],
                mask=n_mask[None, :],
                other=0,
            )
            if UNPACK == "planes":  # plane j: rows k0 + 8 r + j
                offs_p = k0 + 8 * tl.arange(0, BLOCK_K // 8)
                for j in tl.static_range(4):
                    low, high = _int4_plane_pair(packed, j, code_bits, DOT_DTYPE)
                    x_low = _x_tile(x_rows, offs_p + j, m_mask, DOT_DTYPE)
                    x_high = _x_tile(x_rows, offs_p + j + 4, m_mask, DOT_DTYPE)
                    part = _mma(part, x_low, low, SWAP_AB, DOT_PRECISION)
                    part = _mma(part, x_high, high, SWAP_AB, DOT_PRECISION)
                    if HAS_OFFSETS or CODE_BIAS != 0:
                        x_sum += tl.sum(x_low.to(tl.float32), axis=1)
                        x_sum += tl.sum(x_high.to(tl.float32), axis=1)
            else:
                codes = _int4_tile(packed, code_bits, BLOCK_K, BLOCK_N, DOT_DTYPE)
                x = _x_tile(x_rows, k0 + tl.arange(0, BLOCK_K), m_mask, DOT_DTYPE)
                part = _mma(part, x, codes, SWAP_AB, DOT_PRECISION)
                if HAS_OFFSETS or CODE_BIAS != 0:
                    x_sum += tl.sum(x.to(tl.float32), axis=1)
        else:  # int8 [K, N]
            offs_k = k0 + tl.arange(0, BLOCK_K)
            raw = tl.load(
                qweight_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :],
                mask=n_mask[None, :],
                other=0,
            )
            codes = _int8_tile(raw, code_bits, DOT_DTYPE, INT8_CAST)
            x = _x_tile(x_rows, offs_k, m_mask, DOT_DTYPE)
            part = _mma(part, x, codes, SWAP_AB, DOT_PRECISION)
            if CODE_BIAS != 0:
                x_sum += tl.sum(x.to(tl.float32), axis=1)
        if GROUPS != "all":
            if GROUPS == "step":
                ends = True
            else:
                ends = ((k0 + BLOCK_K) % group_size == 0) | (k0 + BLOCK_K >= k_end)
            if ends:  # scale the group's dot once
                group = (k0 // group_size) * N
                scale = tl.load(scales_ptr + group + offs_n, mask=n_mask, other=0.0)
                scale = scale.to(tl.float32)
                acc += part * _along_n(scale, SWAP_AB)
                if HAS_OFFSETS or CODE_BIAS != 0:
                    shift = -CODE_BIAS * scale
                    if HAS_OFFSETS:
                        offset = tl.load(offsets_ptr + group + offs_n, mask=n_mask, other=0.0)
                        shift += offset.to(tl.float32)
                    acc += _along_m(x_sum, SWAP_AB) * _along_n(shift, SWAP_AB)
                part = tl.zeros_like(acc)
                x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if GROUPS == "all":  # one group of K: the slice's dot scaled once
        scale = tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = part * _along_n(scale, SWAP_AB)
        if HAS_OFFSETS or CODE_BIAS != 0:
            shift = -CODE_BIAS * scale
            if HAS_OFFSETS:
                shift += tl.load(offsets_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += _along_m(x_sum, SWAP_AB) * _along_n(shift, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)
    tile = pid_m * num_pid_n + pid_n
    _finish(
        acc, out_ptr, partial_ptr, counter_ptr, tile, pid_k, split_k, offs_m, offs_n, M, N,
        LAST_REDUCES,
    )  # fmt: skip


def mma_dtypes(codes: str, x_dtype: torch.dtype, int8_cast: bool) -> tuple[torch.dtype, float, int]:
    """(the dot's dtype, the code bias, its bits) for codes with x of x_dtype."""
    if x_dtype == torch.float32:
        return torch.float32, 0.0, 0
    if codes == "int4":
        bias, bits = INT4_BIAS[x_dtype]
        return x_dtype, bias, bits
    if int8_cast:
        return x_dtype, 0.0, 0
    return torch.float16, *INT8_BIAS


TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def launch_mma(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int4: int32 [K // 8, N]; int8: int8 [K, N]
    scales: torch.Tensor,  # [K // group_size, N]
    offsets: torch.Tensor | None,
    out: torch.Tensor,  # [M, N]
    partial: torch.Tensor,
    counters: torch.Tensor,
    group_size: int,
    steps: int,
    split_k: int,
    plan,  # int_plan.MatmulPlan, kernel "mma"
    dot_precision: str,
) -> None:
    """Launch `_mma_kernel` on checked operands (int4_matmul.launch sums split-K partials)."""
    codes = "int8" if qweight.dtype == torch.int8 else "int4"
    m, k = x.shape
    n = qweight.shape[1]
    require(
        plan.block_m >= 16 and plan.block_n >= 16 and plan.block_k >= 16,
        f"mma blocks must be >= 16, got {plan.block_m}x{plan.block_n}x{plan.block_k}",
    )
    require(
        k % plan.block_k == 0 and (group_size % plan.block_k == 0 or group_size == k),
        f"mma block_k {plan.block_k} must divide K ({k}) and group_size ({group_size})",
    )
    require(plan.unpack in UNPACKS, f"unpack must be one of {UNPACKS}, got {plan.unpack!r}")
    require(
        codes == "int8" or plan.unpack == "reshape" or plan.block_k >= 128,
        f"int4 planes need block_k >= 128 (16 rows per plane), got {plan.block_k}",
    )
    dot_dtype, bias, bits = mma_dtypes(codes, x.dtype, plan.int8_cast)
    groups = "step" if group_size == plan.block_k else "all" if group_size == k else "any"
    unpack = plan.unpack if codes == "int4" else "reshape"
    n_blocks, m_blocks = triton.cdiv(n, plan.block_n), triton.cdiv(m, plan.block_m)
    _mma_kernel[(m_blocks * n_blocks, split_k)](
        x, qweight, scales, scales if offsets is None else offsets, out, partial, counters,
        m, n, k, x.stride(0), group_size, steps, split_k, bits,
        CODES=codes, HAS_OFFSETS=offsets is not None, BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=8, UNPACK=unpack,
        SWAP_AB=plan.swap_ab, GROUPS=groups, DOT_DTYPE=TL_DTYPES[dot_dtype], CODE_BIAS=bias,
        INT8_CAST=bias == 0.0, LAST_REDUCES=plan.split_reduce == "last",
        DOT_PRECISION=dot_precision, **plan.launch_options(),
    )  # fmt: skip
