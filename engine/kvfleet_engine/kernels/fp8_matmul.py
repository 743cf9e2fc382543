"""fp8 products with e4m3 weights [N, K] and a float32 scale per output channel.

Decode (up to GEMV_MAX_ROWS rows): the weight-only GEMV of `fp8_gemv` (x as it is, no
activation quantization). More rows, W8A8: x [M, K] is quantized per token to e4m3 by a small
Triton kernel (row absmax, scale, cast), then multiplied by the weight with rowwise scales,
either by torch._scaled_mm (cuBLASLt / CUTLASS) or by a Triton fp8 GEMM; `FP8_BACKENDS` says
which per shape class. out = (x_q · x_scale) @ (w · w_scale)ᵀ, as
`quant.layout.fp8_linear_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import next_power_of_2, require
from kvfleet_engine.kernels.fp8_gemv import GEMV_MAX_ROWS, fp8_gemv
from kvfleet_engine.quant.layout import FP8_DTYPE, FP8_MAX

BACKENDS = ("scaled_mm", "triton")
DECODE_MAX_ROWS = 16
BATCH_MAX_ROWS = 128
# shape class (rows up to DECODE_MAX_ROWS, BATCH_MAX_ROWS, more) -> W8A8 backend, the faster in
# bench.quant_gemv / quant_sweep on the H200: the Triton GEMM up to 64 rows, cuBLASLt from 256
FP8_BACKENDS = {"decode": "triton", "batch": "triton", "prompt": "scaled_mm"}


@triton.jit
def _quantize_rows_kernel(
    x_ptr, x_q_ptr, scale_ptr, K, stride_xm, FP8_MAX_VALUE: tl.constexpr, BLOCK_K: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax), 1e-12), FP8_MAX_VALUE)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0)
        q = tl.math.div_rn(x.to(tl.float32), scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX_VALUE), FP8_MAX_VALUE)
        tl.store(x_q_ptr + row * K + offs, q.to(x_q_ptr.dtype.element_ty), mask=offs < K)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 of x [M, K] -> (x_q [M, K], float32 scale [M, 1]), as the layout's."""
    require(x.dim() == 2, f"x must be [M, K], got shape {tuple(x.shape)}")
    require(x.stride(-1) == 1, "x must be contiguous in its last dimension")
    m, k = x.shape
    x_q = torch.empty(m, k, device=x.device, dtype=FP8_DTYPE)  # [M, K]
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)  # [M, 1]
    if m > 0:
        _quantize_rows_kernel[(m,)](
            x, x_q, scale, k, x.stride(0), FP8_MAX_VALUE=FP8_MAX,
            BLOCK_K=min(2048, next_power_of_2(k)),
        )  # fmt: skip
    return x_q, scale


@triton.jit
def _fp8_gemm_kernel(
    x_q_ptr, weight_ptr, x_scale_ptr, weight_scale_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_pid_n)) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * num_pid_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x_q = tl.load(
            x_q_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        weight = tl.load(  # [BLOCK_K, BLOCK_N] of the [N, K] weight
            weight_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        acc = tl.dot(x_q, weight, acc)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
    weight_scale = tl.load(weight_scale_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * x_scale[:, None] * weight_scale[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm_blocks(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the Triton fp8 GEMM for M rows."""
    if m <= DECODE_MAX_ROWS:
        return 16, 32, 256, 4, 4  # H200, 16 rows: 103 us per 8B layer (BLOCK_N 64: 110)
    if m <= 128:
        return 64, 128, 128, 4, 4
    return 128, 128, 128, 8, 4


def triton_fp8_gemm(
    x_q: torch.Tensor,  # e4m3 [M, K]
    x_scale: torch.Tensor,  # float32 [M, 1]
    weight: torch.Tensor,  # e4m3 [N, K]
    weight_scale: torch.Tensor,  # float32 [N]
    out_dtype: torch.dtype,
    blocks: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    m, k = x_q.shape
    n = weight.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = blocks or fp8_gemm_blocks(m)
    out = torch.empty(m, n, device=x_q.device, dtype=out_dtype)  # [M, N]
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](
        x_q, weight, x_scale, weight_scale, out, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def scaled_mm_fp8(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """torch._scaled_mm with rowwise scales (bf16 out, the only one rowwise scaling offers)."""
    return torch._scaled_mm(
        x_q,
        weight.t(),  # [K, N], column-major
        scale_a=x_scale,  # [M, 1]
        scale_b=weight_scale.view(1, -1),  # [1, N]
        out_dtype=torch.bfloat16,
    )


def fp8_backend(m: int, n: int, k: int, out_dtype: torch.dtype) -> str:
    """Which backend runs an [M, K] x [K, N] product (one of BACKENDS)."""
    shape_class = "decode" if m <= DECODE_MAX_ROWS else "batch" if m <= BATCH_MAX_ROWS else "prompt"
    backend = FP8_BACKENDS[shape_class]
    if out_dtype != torch.bfloat16 or k % 16 or n % 16:  # what rowwise _scaled_mm accepts
        return "triton"
    return backend


def fp8_matmul(
    x: torch.Tensor,  # [M, K] bfloat16 / float16
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor,  # float32 [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x @ weightᵀ with the weight's scales -> [M, N] in out_dtype (bias is the caller's): the
    weight-only GEMV up to GEMV_MAX_ROWS rows, W8A8 (x quantized per token) above."""
    require(x.dim() == 2, f"x must be [M, K], got shape {tuple(x.shape)}")
    require(
        x.dtype in (torch.bfloat16, torch.float16), f"x must be bfloat16 or float16, got {x.dtype}"
    )
    m, k = x.shape
    require(
        weight.dim() == 2 and weight.shape[1] == k,
        f"weight must be [N, {k}] for x [M, {k}], got {tuple(weight.shape)}",
    )
    n = weight.shape[0]
    require(weight.dtype == FP8_DTYPE, f"weight must be {FP8_DTYPE}, got {weight.dtype}")
    require(
        weight_scale.shape == (n,) and weight_scale.dtype == torch.float32,
        f"weight_scale must be float32 [{n}], got {weight_scale.dtype} {tuple(weight_scale.shape)}",
    )
    require(
        out_dtype in (torch.bfloat16, torch.float16),
        f"out_dtype must be bfloat16 or float16, got {out_dtype}",
    )
    for name, tensor in (("weight", weight), ("weight_scale", weight_scale)):
        require(tensor.device == x.device, f"{name} must be on the device of x ({x.device})")
        require(tensor.is_contiguous(), f"{name} must be contiguous")
    if x.device.type == "cuda":
        require(
            torch.cuda.get_device_capability(x.device) >= (8, 9),
            "fp8 products need a GPU of compute capability >= 8.9 (Ada, Hopper or newer)",
        )
    if m <= GEMV_MAX_ROWS:
        return fp8_gemv(x, weight, weight_scale, out_dtype)
    x_q, x_scale = quantize_fp8_rows(x)
    if fp8_backend(m, n, k, out_dtype) == "scaled_mm":
        return scaled_mm_fp8(x_q, x_scale, weight, weight_scale)
    return triton_fp8_gemm(x_q, x_scale, weight, weight_scale, out_dtype)
