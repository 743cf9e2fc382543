"""The fp8 weight-only GEMV (decode rows, up to GEMV_MAX_ROWS): x [M, K] as it is times e4m3
weights [N, K] converted to x's dtype, on the tensor cores (tl.dot, rows padded to 16; on the
H200 it beat the FMA form on float32 weights even for one row) or, as a plan may choose, by FMAs;
no activation quantization, so no second kernel and no rounding of x: at least as accurate as
W8A8; out = x @ (w · w_scale)ᵀ. Its plan table (`GEMV_TABLE`, filled by
`int_plan.install_plans` from the sweep's winners) picks blocks per product shape.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import dot_precision, require
from kvfleet_engine.kernels.int_plan import load_env_plans, put_rows, rows_at_least, split_for
from kvfleet_engine.kernels.pdl import _start, launch_options
from kvfleet_engine.kernels.split_k import COUNTERS, _finish, _sum_splits_kernel, split_k_buffers

GEMV_MAX_ROWS = 16  # up to this many rows: the weight-only GEMV (H200: 67% of copy at 16 rows)


@triton.jit(do_not_specialize=["steps_per_split", "split_k"])  # one compile for every split
def _fp8_gemv_kernel(
    x_ptr, weight_ptr, weight_scale_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, stride_xm, steps_per_split, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    LAST_REDUCES: tl.constexpr, DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr,
    HALF_DOT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Weight-only: each program owns BLOCK_N weight rows and one of SPLIT_K slices of K; the
    FMA form keeps x·w in a [BLOCK_M, BLOCK_N, BLOCK_K] tile reduced once at the end, the dot
    form runs tl.dot on the weights converted to x's dtype (exact: e4m3 fits in 16 bits).
    HALF_DOT: the dot in float16 instead (x rounded to float16, clamped at ±65504; e4m3 to
    float16 is one convert per two weights on sm_89+, bfloat16 goes through float32); SWAP_AB:
    the weight is the dot's left operand (out^T = W x^T)."""
    _start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + steps_per_split * BLOCK_K)
    if USE_DOT and SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        weight = tl.load(  # [BLOCK_N, BLOCK_K]
            weight_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        x = tl.load(  # [BLOCK_M, BLOCK_K]
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if USE_DOT:
            if HALF_DOT:
                x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
                w = weight.to(tl.float16)
            else:
                w = weight.to(tl.float32).to(x.dtype)
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            acc += x.to(tl.float32)[:, None, :] * weight.to(tl.float32)[None, :, :]
    if USE_DOT and SWAP_AB:
        out = tl.trans(acc)
    elif USE_DOT:
        out = acc
    else:
        out = tl.sum(acc, axis=2)
    weight_scale = tl.load(weight_scale_ptr + offs_n, mask=n_mask, other=0.0)
    _finish(
        out * weight_scale[None, :], out_ptr, partial_ptr, counter_ptr, pid_n, pid_k, split_k,
        offs_m, offs_n, M, N, LAST_REDUCES,
    )  # fmt: skip


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, split_k or 0: about 4 programs per SM, use_dot, reduce)
Fp8GemvBlocks = tuple[int, int, int, int, int, bool, str]


@dataclass(frozen=True)
class Fp8GemvPlan:
    """The weight-only GEMV's blocks and variant (fields of Fp8GemvBlocks, then the rest)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    split_k: int = 0  # 0: about 4 programs per SM
    use_dot: bool = True
    reduce: str = "last"  # one of int_plan.SPLIT_REDUCE
    swap_ab: bool = False
    half_dot: bool = False
    num_stages: int = 3


# (N, K) -> [(rows, plan)] sorted by rows: the plan for M rows is the first with rows >= M
# (fp8_gemv_blocks past the last); filled by int_plan.install_plans.
GEMV_TABLE: dict[tuple[int, int], list[tuple[int, Fp8GemvPlan]]] = {}
GEMV_PLAN_FIELDS = tuple(field.name for field in fields(Fp8GemvPlan))


def install_gemv_plan(rows: int, n: int, k: int, plan: dict) -> None:
    unknown = sorted(set(plan) - set(GEMV_PLAN_FIELDS))
    if unknown:
        raise ValueError(f"fp8 plan fields {unknown} unknown; allowed: {list(GEMV_PLAN_FIELDS)}")
    put_rows(GEMV_TABLE, (n, k), rows, Fp8GemvPlan(**plan))


def table_gemv_plan(m: int, n: int, k: int) -> Fp8GemvPlan | None:
    load_env_plans()
    plan: Fp8GemvPlan | None = rows_at_least(GEMV_TABLE, (n, k), m)
    return plan


def fp8_gemv_blocks(m: int) -> Fp8GemvBlocks:
    """The weight-only GEMV's blocks for M rows (the dot form for all: at one row the FMA form
    measured 112 us per 8B layer, the dot form 78 us at 4 rows)."""
    return 16, 64, 128, 4, 0, True, "last"


def fp8_gemv(
    x: torch.Tensor,  # [M, K] bfloat16 / float16
    weight: torch.Tensor,  # e4m3 [N, K]
    weight_scale: torch.Tensor,  # float32 [N]
    out_dtype: torch.dtype,
    blocks: Fp8GemvBlocks | Fp8GemvPlan | None = None,
) -> torch.Tensor:
    """x @ (weight · weight_scale)ᵀ without quantizing x -> [M, N] in out_dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if blocks is None:
        blocks = table_gemv_plan(m, n, k) or fp8_gemv_blocks(m)
    plan = blocks if isinstance(blocks, Fp8GemvPlan) else Fp8GemvPlan(*blocks)
    block_m, block_n, block_k, num_warps = plan.block_m, plan.block_n, plan.block_k, plan.num_warps
    split, use_dot, reduce = plan.split_k, plan.use_dot, plan.reduce
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)  # [M, N]
    if m == 0:
        return out
    n_blocks, k_steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    require(n_blocks <= COUNTERS, f"at most {COUNTERS} output tiles per product")
    steps = triton.cdiv(k_steps, split or split_for(n_blocks, k_steps, x.device))
    split_k, partial, counters = split_k_buffers(triton.cdiv(k_steps, steps), m, n, x.device)
    _fp8_gemv_kernel[(n_blocks, split_k)](
        x, weight, weight_scale, out, partial, counters, m, n, k, x.stride(0), steps, split_k,
        BLOCK_M=max(16, block_m) if use_dot else block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_DOT=use_dot, LAST_REDUCES=reduce == "last", DOT_PRECISION=dot_precision(x.dtype),
        SWAP_AB=plan.swap_ab, HALF_DOT=plan.half_dot and x.dtype != torch.float32,
        num_warps=num_warps, num_stages=plan.num_stages, **launch_options(x.device),
    )  # fmt: skip
    if split_k > 1 and reduce != "last":
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            partial, out, m * n, split_k, BLOCK=block, **launch_options(x.device)
        )
    return out
