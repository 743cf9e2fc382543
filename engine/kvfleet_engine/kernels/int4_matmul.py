"""Products with integer weights, dequantized inside the kernel: x [M, K] @ W [K, N] where
W = code * scale + offset per group of `group_size` rows (the layouts of `quant.layout`).

int4 is the general case (packed unsigned codes with scales and offsets); int8 runs the same
kernels with 8-bit signed codes and no offsets (`int8_matmul`). Three kernels, one per shape class:
- GEMV (decode, M <= 16): each program owns a BLOCK_N slice of outputs and one of SPLIT_K slices
  of K, streams its weights once, and sums x·code per group before scaling (one FMA per weight
  and row); split-K partials are summed by a second, small kernel.
- GEMM (prompts): tiles of dequantized weights into tl.dot.
- dequantize + cuBLAS (long prompts): the weight is expanded once into x's dtype; at thousands of
  rows the product is compute-bound and the expansion is a few percent of it.
Codes become floats through their bits (0x4B000000 | code is the float 2^23 + code), not through
integer-to-float conversions, which issue at a fraction of the FMA rate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import FLOAT_DTYPES, dot_precision, next_power_of_2, require

GEMV_MAX_ROWS = 16  # above this many rows of x the tiled GEMM reads the weights fewer times
DEQUANTIZE_MIN_ROWS = 1024  # from this many rows, dequantize once and use cuBLAS
KERNELS = ("gemv", "gemm", "dequantize")


@dataclass(frozen=True)
class MatmulPlan:
    kernel: str  # one of KERNELS
    block_m: int  # rows of x per program (gemv: all of them, a power of two)
    block_n: int  # output columns per program
    block_k: int  # rows of the weight per loop step; a power of two dividing group_size
    split_k: int = 1  # gemv: slices of K summed by a second kernel
    use_dot: bool = False  # gemv: tl.dot on the tensor cores instead of FMAs
    int4_codes: str = "int4"  # how int4 codes unpack: "int4" (reshape) or "int4-rows" (gather)
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs of work, so split-K is exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_matmul(m: int, n: int, k: int, group_size: int, device: torch.device) -> MatmulPlan:
    """Block sizes by shape class (a fixed table, so nothing is tuned inside graph capture)."""
    pow2_of_group = group_size & -group_size  # the largest power of two dividing group_size
    if m <= GEMV_MAX_ROWS:
        block_k = min(max(16, 128 // next_power_of_2(m)), pow2_of_group)  # x·code is M·K·N
        block_n = 128
        n_blocks, k_blocks = triton.cdiv(n, block_n), k // block_k
        wanted = max(1, 4 * _num_sms(device) // n_blocks)  # ~4 programs per SM
        steps = triton.cdiv(k_blocks, min(wanted, max(1, k_blocks // 2)))
        return MatmulPlan(
            "gemv", next_power_of_2(m), block_n, block_k, triton.cdiv(k_blocks, steps)
        )
    if m >= DEQUANTIZE_MIN_ROWS or pow2_of_group < 16:  # tl.dot needs K tiles of >= 16
        return MatmulPlan("dequantize", 0, 128, min(64, pow2_of_group))
    block_m = 64 if m <= 64 else 128
    return MatmulPlan(
        "gemm", block_m, 128, min(64, pow2_of_group), num_warps=8 if block_m == 128 else 4
    )


@triton.jit
def _load_codes(
    qweight_ptr, k0, offs_n, n_mask, N,
    CODES: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Codes of weight rows k0 .. k0 + BLOCK_K, columns offs_n, as float32 [BLOCK_K, BLOCK_N].
    CODES: "int4" (each packed int32 loaded once, its 8 nibbles reshaped into rows), "int4-rows"
    (each row loads its int32 and shifts: 8x the load instructions, no reshape) or "int8"."""
    if CODES == "int4":  # int32 [K // 8, N]: row k in bits 4 * (k % 8) of packed row k // 8
        rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(
            qweight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=n_mask[None, :]
        )
        nibbles = (packed[:, None, :] >> (4 * tl.arange(0, 8))[None, :, None]) & 0xF
        bits = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    elif CODES == "int4-rows":
        rows = k0 + tl.arange(0, BLOCK_K)
        packed = tl.load(
            qweight_ptr + (rows // 8)[:, None].to(tl.int64) * N + offs_n[None, :],
            mask=n_mask[None, :],
        )
        bits = ((packed >> (4 * (rows % 8))[:, None]) & 0xF) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    else:  # int8 [K, N], symmetric: 2^23 + 128 + code, then subtract
        rows = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(
            qweight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=n_mask[None, :]
        )
        bits = codes.to(tl.int32) + 0x4B000080
        return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit(do_not_specialize=["steps_per_split"])  # one compile for every split of K
def _gemv_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,  # [M, N] in x's dtype, or float32 [SPLIT_K, M, N] partial sums
    M,
    N,
    K,
    stride_xm,
    group_size,
    steps_per_split,
    CODES: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + steps_per_split * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):  # BLOCK_K divides group_size: one group per step
        codes = _load_codes(qweight_ptr, k0, offs_n, n_mask, N, CODES, BLOCK_K, BLOCK_N)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None],
            other=0.0,
        )
        if USE_DOT:
            dots = tl.dot(x, codes.to(x.dtype), input_precision=DOT_PRECISION)
        else:
            dots = tl.sum(x.to(tl.float32)[:, :, None] * codes[None, :, :], axis=1)
        group = (k0 // group_size) * N
        scale = tl.load(scales_ptr + group + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += dots * scale[None, :]
        if HAS_OFFSETS:
            offset = tl.load(offsets_ptr + group + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * offset[None, :]
    out = out_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, numel, split_k, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(split_k):
        acc += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantized_tile(
    qweight_ptr, scales_ptr, offsets_ptr, k0, offs_n, n_mask, N, group_size,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """code * scale + offset of rows k0 .. k0 + BLOCK_K (one group), float32 [BLOCK_K, BLOCK_N]."""
    codes = _load_codes(qweight_ptr, k0, offs_n, n_mask, N, CODES, BLOCK_K, BLOCK_N)
    group = (k0 // group_size) * N
    scale = tl.load(scales_ptr + group + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    weight = codes * scale[None, :]
    if HAS_OFFSETS:
        offset = tl.load(offsets_ptr + group + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        weight += offset[None, :]
    return weight


@triton.jit
def _gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, out_ptr, M, N, K, stride_xm, group_size,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_pid_n)) * GROUP_M  # GROUP_M row blocks share weight tiles
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * num_pid_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        weight = _dequantized_tile(
            qweight_ptr, scales_ptr, offsets_ptr, k0, offs_n, n_mask, N, group_size,
            CODES, HAS_OFFSETS, BLOCK_K, BLOCK_N,
        )  # fmt: skip
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None],
            other=0.0,
        )
        acc = tl.dot(x, weight.to(x.dtype), acc, input_precision=DOT_PRECISION)
    out = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequantize_kernel(
    qweight_ptr, scales_ptr, offsets_ptr, weight_ptr, N, group_size,
    CODES: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    weight = _dequantized_tile(
        qweight_ptr, scales_ptr, offsets_ptr, k0, offs_n, n_mask, N, group_size,
        CODES, HAS_OFFSETS, BLOCK_K, BLOCK_N,
    )  # fmt: skip
    rows = k0 + tl.arange(0, BLOCK_K)
    out = weight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, weight.to(weight_ptr.dtype.element_ty), mask=n_mask[None, :])


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


def launch(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int4: int32 [K // 8, N]; int8: int8 [K, N]
    scales: torch.Tensor,  # [K // group_size, N]
    offsets: torch.Tensor | None,  # [K // group_size, N] (int4) or None
    group_size: int,
    plan: MatmulPlan,
) -> torch.Tensor:
    """Run one plan on checked operands; returns [M, N] in x's dtype."""
    codes = "int8" if qweight.dtype == torch.int8 else plan.int4_codes
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)  # [M, N]
    if m == 0:
        return out
    offsets_arg = scales if offsets is None else offsets  # not read without offsets
    common = dict(CODES=codes, HAS_OFFSETS=offsets is not None, BLOCK_K=plan.block_k)
    if plan.kernel == "gemv":
        steps = triton.cdiv(k // plan.block_k, plan.split_k)
        split_k = triton.cdiv(k // plan.block_k, steps)  # no empty slices
        target = out if split_k == 1 else torch.empty(split_k, m, n, device=x.device)
        _gemv_kernel[(triton.cdiv(n, plan.block_n), split_k)](
            x, qweight, scales, offsets_arg, target, m, n, k, x.stride(0), group_size, steps,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, USE_DOT=plan.use_dot,
            DOT_PRECISION=dot_precision(x.dtype), num_warps=plan.num_warps,
            num_stages=plan.num_stages, **common,
        )  # fmt: skip
        if split_k > 1:
            block = 1024
            _sum_splits_kernel[(triton.cdiv(m * n, block),)](
                target, out, m * n, split_k, BLOCK=block
            )
    elif plan.kernel == "gemm":
        grid = (triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n),)
        _gemm_kernel[grid](
            x, qweight, scales, offsets_arg, out, m, n, k, x.stride(0), group_size,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, GROUP_M=8,
            DOT_PRECISION=dot_precision(x.dtype), num_warps=plan.num_warps,
            num_stages=plan.num_stages, **common,
        )  # fmt: skip
    else:
        weight = torch.empty(k, n, device=x.device, dtype=x.dtype)  # [K, N]
        _dequantize_kernel[(k // plan.block_k, triton.cdiv(n, plan.block_n))](
            qweight, scales, offsets_arg, weight, n, group_size, BLOCK_N=plan.block_n, **common
        )
        torch.matmul(x, weight, out=out)
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
