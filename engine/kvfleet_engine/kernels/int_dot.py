"""The integer-weight products on the tensor cores and through cuBLAS (decode batches and
prompts): `_dot_kernel` (code tiles into tl.dot, int4 as nibble planes or reshaped, optionally as
biased 16-bit codes, CODE_BIAS) and `_dequantize_kernel` (the weight expanded once into x's dtype
for torch.matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.int_codes import _load_codes, _shifted_plane
from kvfleet_engine.kernels.pdl import _start
from kvfleet_engine.kernels.split_k import _finish

# x dtype -> (bias, its bits): code | bits is code + bias exactly (the ulp at the bias is 1)
CODE_BIAS = {torch.bfloat16: (128.0, 0x4300), torch.float16: (1024.0, 0x6400)}


# ---- dot (tensor cores) ------------------------------------------------------------------------


@triton.jit(do_not_specialize=["steps_per_split", "split_k", "code_bits"])
def _dot_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, stride_xm, group_size, steps_per_split, split_k, code_bits,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PLANES: tl.constexpr,
    SCALE_AFTER_DOT: tl.constexpr, CODE_BIAS: tl.constexpr, LAST_REDUCES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """CODE_BIAS (int4 planes, scales after the dot, 16-bit x; else 0): each code enters the dot
    as code + CODE_BIAS in x's dtype, made from its bits alone (code | code_bits, the bits of
    CODE_BIAS: 0x4300 = 128 in bfloat16, 0x6400 = 1024 in float16; exact, one LOP3 after the
    shift and no float ops), and the group's CODE_BIAS · Σx comes off with the offsets."""
    _start(PDL)
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
