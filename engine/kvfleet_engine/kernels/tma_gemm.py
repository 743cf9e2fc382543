"""A persistent 16-bit GEMM whose operands move by TMA (Hopper's tensor memory accelerator):
out [M, N] = x [M, K] @ weight [N, K]ᵀ, float32 accumulation.

Written for a decode step's products (M of 64-512 rows, the 8B layer's N and K), where cuBLAS
runs at ≈ 62% of the H200's dense peak (bench/NOTES.md sections 14, 21, 23) and section 21's
plain tiled Triton GEMM lost to it by 15-30%. Here each of NUM_SMS programs walks the output
tiles (GROUP_M tile rows at a time, so neighbours share the weight's tiles in L2); a tile's
operands come through TMA descriptors (no address arithmetic, no masks: the descriptor fills
out-of-range rows with zeros and clips the store), which the compiler pipelines over
`num_stages` k-steps into wgmma.

The model's 16-bit linears use it only for the shapes the plan file lists (kind "bf16-tma"
entries of $KVFLEET_QUANT_PLANS, see int_plan; `bench/bf16_gemm_probe.py --write-plans` writes
them: the TMA GEMM's best blocks where it beat cuBLAS, null where it did not; a product of M
rows takes the first entry whose rows >= M): without such entries every product stays with
cuBLAS.

Descriptors need 16-byte aligned rows and starts: K and N multiples of 8, operands whose
first element is 16-byte aligned (`tma_gemm_fits`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kvfleet_engine.kernels.checks import num_sms, require
from kvfleet_engine.kernels.int_plan import load_env_plans, put_rows, rows_at_least

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
Blocks = tuple[int, int, int, int, int]
DEFAULT_BLOCKS: Blocks = (64, 128, 64, 4, 4)
# (N, K) -> [(rows, blocks)] sorted by rows; filled by int_plan.install_plans (kind "bf16-tma").
TMA_TABLE: dict[tuple[int, int], list[tuple[int, Blocks | None]]] = {}


@triton.jit
def _tma_gemm_kernel(
    x_desc, w_desc, out_desc, M, N, K, num_tiles, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    # Plain int bounds (the interpreter cannot loop from a program id); the last round's
    # programs past num_tiles skip it.
    for first in range(0, num_tiles, num_programs):
        tile = first + tl.program_id(0)
        if tile < num_tiles:
            first_m = (tile // in_group) * GROUP_M
            rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
            pid_m = first_m + (tile % in_group) % rows_in_group
            pid_n = (tile % in_group) // rows_in_group
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = x_desc.load([pid_m * BLOCK_M, k0])
                w = w_desc.load([pid_n * BLOCK_N, k0])
                acc = tl.dot(x, w.T, acc)
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))


def tma_gemm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the descriptors can hold these operands: contiguous 16-bit rows of a multiple of
    16 bytes from a 16-byte aligned start (a view's storage offset can break it), one dtype,
    K and N not 0 (TensorDescriptor asserts each)."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride() == (x.shape[1], 1)  # is_contiguous() passes one row of any stride
        and weight.stride() == (weight.shape[1], 1)
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % 8 == 0
        and weight.shape[0] % 8 == 0
        and x.shape[1] > 0
        and weight.shape[0] > 0
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def tma_gemm(
    x: torch.Tensor,  # [M, K] bfloat16 / float16, contiguous
    weight: torch.Tensor,  # [N, K], x's dtype, contiguous
    blocks: Blocks = DEFAULT_BLOCKS,
    num_programs: int | None = None,  # default: one per SM
) -> torch.Tensor:
    """x @ weightᵀ -> [M, N] in x's dtype."""
    require(
        tma_gemm_fits(x, weight),
        "tma_gemm needs contiguous, 16-byte aligned 16-bit [M, K] and [N, K] of one dtype, K and "
        "N positive multiples of 8",
    )
    block_m, block_n, block_k, num_warps, num_stages = blocks
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if num_programs is None:
        num_programs = num_sms(x.device)
    num_programs = min(num_programs, num_tiles)
    _tma_gemm_kernel[(num_programs,)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]),
        m, n, k, num_tiles, num_programs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def install_tma_plan(rows: int, n: int, k: int, plan: dict[str, Any]) -> None:
    """Add a table entry (int_plan.install_plans, kind "bf16-tma"): plan {"blocks": [BLOCK_M,
    BLOCK_N, BLOCK_K, warps, stages]} or {"blocks": null} (cuBLAS for those rows); ValueError
    naming a malformed one."""
    if set(plan) != {"blocks"}:
        raise ValueError(f"TMA GEMM plan {plan!r}: needs blocks, and nothing else")
    raw = plan["blocks"]
    blocks: Blocks | None = None
    if raw is not None:
        numbers = [int(b) for b in raw]
        if len(numbers) != 5:
            raise ValueError(f"TMA GEMM plan {plan!r}: blocks are 5 numbers or null")
        blocks = (numbers[0], numbers[1], numbers[2], numbers[3], numbers[4])
    put_rows(TMA_TABLE, (n, k), rows, blocks)


def planned_blocks(x: torch.Tensor, weight: torch.Tensor) -> Blocks | None:
    """The plan's blocks for x @ weightᵀ, None when no entry covers it (cuBLAS then)."""
    load_env_plans()
    if not TMA_TABLE or not tma_gemm_fits(x, weight):
        return None
    shape = (weight.shape[0], weight.shape[1])
    blocks: Blocks | None = rows_at_least(TMA_TABLE, shape, x.shape[0])
    return blocks
