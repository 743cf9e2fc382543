"""fp8 products with e4m3 weights [N, K] and a float32 scale per output channel.

Decode (up to GEMV_MAX_ROWS rows): the weight-only GEMV of `fp8_gemv` (x as it is, no
activation quantization). More rows, W8A8: x [M, K] is quantized per token to e4m3 (`fp8_rows`:
row absmax, scale, cast), then multiplied by the weight with rowwise scales, either by
torch._scaled_mm (cuBLASLt / CUTLASS) or by a Triton fp8 GEMM; `FP8_BACKENDS` says which per
shape class. out = (x_q · x_scale) @ (w · w_scale)ᵀ, as `quant.layout.fp8_linear_reference`.
`fp8_silu_and_mul_matmul` is the same product of a gated MLP's silu(gate) * up, whose e4m3 rows
come from one kernel with the activation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels import fp8_rows
from kvfleet_engine.kernels.activation import silu_and_mul
from kvfleet_engine.kernels.checks import require
from kvfleet_engine.kernels.fp8_gemv import GEMV_MAX_ROWS, fp8_gemv
from kvfleet_engine.kernels.fp8_rows import Fp8Rows, quantize_fp8_rows, silu_and_mul_fp8
from kvfleet_engine.kernels.int_plan import load_env_plans, put_rows, rows_at_least
from kvfleet_engine.quant.layout import FP8_DTYPE

BACKENDS = ("scaled_mm", "triton")
DECODE_MAX_ROWS = 16
BATCH_MAX_ROWS = 128
# shape class (rows up to DECODE_MAX_ROWS, BATCH_MAX_ROWS, more) -> W8A8 backend, the faster in
# bench.quant_gemv / quant_sweep on the H200: the Triton GEMM up to 64 rows, cuBLASLt from 256
FP8_BACKENDS = {"decode": "triton", "batch": "triton", "prompt": "scaled_mm"}


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


# Hopper's fp8 tensor cores accumulate in fewer bits than float32 unless the kernel promotes the
# partial sums every few k-blocks; without that promotion ("fast accumulation", what vLLM's sm90
# CUTLASS fp8 kernels and TensorRT-LLM use) the 8B layer's four products at 16,384 rows ran
# 1.96x bf16 instead of 1.62x on an H100 (`bench/scaled_mm_probe.py`, bench/NOTES.md section 22).
FAST_ACCUM = True


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
        use_fast_accum=FAST_ACCUM,
    )


@dataclass(frozen=True)
class W8A8Plan:
    """How a W8A8 product runs: `backend` (one of BACKENDS) and, for "triton", its `blocks`
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""

    backend: str
    blocks: tuple[int, int, int, int, int] | None = None


# (N, K) -> [(rows, plan)] sorted by rows: the plan for M rows is the first whose rows >= M
# (the shape-class rules of `fp8_backend` past the last). Filled by int_plan.install_plans from
# plan entries of kind "fp8-w8a8" (bench.quant_sweep's winners above 16 rows).
W8A8_TABLE: dict[tuple[int, int], list[tuple[int, W8A8Plan]]] = {}


def install_w8a8_plan(rows: int, n: int, k: int, plan: dict[str, Any]) -> None:
    """Add a table entry (ValueError naming an unknown backend or field)."""
    unknown = sorted(set(plan) - {"backend", "blocks"})
    if unknown:
        raise ValueError(f"fp8-w8a8 plan fields {unknown} unknown; allowed: ['backend', 'blocks']")
    backend, blocks = plan.get("backend"), plan.get("blocks")
    if backend not in BACKENDS:
        raise ValueError(f"fp8-w8a8 backend {backend!r} unknown; allowed: {list(BACKENDS)}")
    if backend == "triton" and (blocks is None or len(blocks) != 5):
        raise ValueError(
            "an fp8-w8a8 triton plan needs blocks [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages]"
        )
    made = W8A8Plan(backend, None if blocks is None else tuple(int(b) for b in blocks))  # type: ignore[arg-type]
    put_rows(W8A8_TABLE, (n, k), rows, made)


def w8a8_plan(m: int, n: int, k: int, out_dtype: torch.dtype) -> W8A8Plan:
    """The plan for an [M, K] x [K, N] W8A8 product: the table's, else the shape-class rules."""
    load_env_plans()
    plan: W8A8Plan | None = rows_at_least(W8A8_TABLE, (n, k), m)
    scaled_mm_ok = out_dtype == torch.bfloat16 and not k % 16 and not n % 16
    if plan is not None and (plan.backend == "triton" or scaled_mm_ok):
        return plan
    return W8A8Plan(fp8_backend(m, n, k, out_dtype))


def fp8_backend(m: int, n: int, k: int, out_dtype: torch.dtype) -> str:
    """Which backend runs an [M, K] x [K, N] product by the shape-class rules (one of BACKENDS)."""
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
    _check_16_bit(x, "x")
    _check_operands(x, x.shape[1], weight, weight_scale, out_dtype)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return fp8_gemv(x, weight, weight_scale, out_dtype)
    return _w8a8(*quantize_fp8_rows(x), weight, weight_scale, out_dtype)


def takes_fp8_rows(m: int) -> bool:
    """Whether fp8_matmul quantizes the rows of an [m, K] input (W8A8): a producer may hand
    them over as Fp8Rows (`fp8_rows_matmul`) instead."""
    return m > GEMV_MAX_ROWS


def fp8_rows_matmul(
    rows: Fp8Rows,  # per-token e4m3 [M, K] and float32 scales [M, 1]
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor,  # float32 [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The W8A8 product of rows quantized by their producer (a norm) -> [M, N]: what
    fp8_matmul computes from the rows' 16-bit form."""
    codes, scale = rows
    require(codes.dim() == 2 and codes.dtype == FP8_DTYPE, "rows must be e4m3 [M, K]")
    require(scale.shape == (codes.shape[0], 1), f"row scales must be [{codes.shape[0]}, 1]")
    require(codes.is_contiguous() and scale.is_contiguous(), "rows and scales must be contiguous")
    _check_operands(codes, codes.shape[1], weight, weight_scale, out_dtype)
    return _w8a8(codes, scale, weight, weight_scale, out_dtype)


def fp8_silu_and_mul_matmul(
    gate_up: torch.Tensor,  # [M, 2 * K] bfloat16 / float16: [gate | up]
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor,  # float32 [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp8_matmul(silu(gate) * up, ...) -> [M, N]: above GEMV_MAX_ROWS rows the activation's
    e4m3 rows come from the kernel that computes it (`fp8_rows.silu_and_mul_fp8`)."""
    require(gate_up.dim() == 2, f"gate_up must be [M, 2 * K], got shape {tuple(gate_up.shape)}")
    require(gate_up.shape[1] % 2 == 0, "gate_up must have an even number of columns")
    inner = gate_up.shape[1] // 2
    _check_16_bit(gate_up, "gate_up")
    _check_operands(gate_up, inner, weight, weight_scale, out_dtype)
    if gate_up.shape[0] <= GEMV_MAX_ROWS or inner > fp8_rows.ROW_MAX_COLS:
        return fp8_matmul(silu_and_mul(gate_up), weight, weight_scale, out_dtype)
    return _w8a8(*silu_and_mul_fp8(gate_up), weight, weight_scale, out_dtype)


def _w8a8(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    m, k = x_q.shape
    plan = w8a8_plan(m, weight.shape[0], k, out_dtype)
    if plan.backend == "scaled_mm":
        return scaled_mm_fp8(x_q, x_scale, weight, weight_scale)
    return triton_fp8_gemm(x_q, x_scale, weight, weight_scale, out_dtype, plan.blocks)


def _check_16_bit(x: torch.Tensor, name: str) -> None:
    require(
        x.dtype in (torch.bfloat16, torch.float16),
        f"{name} must be bfloat16 or float16, got {x.dtype}",
    )


def _check_operands(
    x: torch.Tensor, k: int, weight: torch.Tensor, weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> None:  # fmt: skip
    require(
        weight.dim() == 2 and weight.shape[1] == k,
        f"weight must be [N, {k}] for inputs of {k} features, got {tuple(weight.shape)}",
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
