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
- mma (`int_mma`, any rows): the tensor-core kernel with codes made into 16-bit dot operands
  from their bits (code + bias, two int4 codes per mask), scales once per group after the dot,
  optionally with the weight as the left operand (swap AB) and split-K for decode rows.
- dequantize + cuBLAS (long prompts): the weight is expanded once into x's dtype; at thousands of
  rows the product is compute-bound and the expansion is a few percent of it.
Split-K partials are summed by the last program of each output tile (a counter, deterministic
order) or by a second kernel. Codes become floats through their bits, not through integer-to-float
conversions, which issue at a fraction of the FMA rate.

Modules: `int_plan` (the shape table, `plan_matmul`), `int_gemv` (the GEMVs; one-row ones also in
`int_gemv_lean` and, int4 in float16 pairs, `int_gemv_half2`), `int_dot` (dot and
dequantize), `int_codes` (codes to floats) and `split_k` (partials and their sums); this one holds
the wrappers: the operand checks and `launch`, which runs a plan.
"""

from __future__ import annotations

import torch
import triton

from kvfleet_engine.kernels.checks import FLOAT_DTYPES, dot_precision, require
from kvfleet_engine.kernels.int_codes import MAGIC
from kvfleet_engine.kernels.int_dot import CODE_BIAS, _dequantize_kernel, _dot_kernel
from kvfleet_engine.kernels.int_gemv import _gemv_kernel, _gemv_row_kernel, row_gemv_fits
from kvfleet_engine.kernels.int_gemv_half2 import _gemv_half2_kernel
from kvfleet_engine.kernels.int_gemv_lean import INT8_FLIP, MAGICS, PRMT, _gemv_lean_kernel
from kvfleet_engine.kernels.int_mma import launch_mma
from kvfleet_engine.kernels.int_plan import INTERPRETED, MatmulPlan, plan_matmul
from kvfleet_engine.kernels.pdl import launch_options
from kvfleet_engine.kernels.split_k import COUNTERS, _sum_splits_kernel, split_k_buffers


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


def _check_one_row_steps(plan: MatmulPlan, group_size: int, k: int) -> None:
    require(
        plan.block_k % 8 == 0 and (group_size % plan.block_k == 0 or group_size == k),
        f"{plan.kernel} block_k {plan.block_k} must divide group_size ({group_size}) or K be "
        "one group",
    )


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
    m_blocks = 1 if plan.kernel in ("gemv", "lean", "half2") else triton.cdiv(m, plan.block_m)
    require(m_blocks * n_blocks <= COUNTERS, f"at most {COUNTERS} output tiles per product")
    last_reduces = plan.split_reduce == "last"
    # One-row kernels: whether each step ends a group, every step, only K's last, or any.
    groups = "step" if group_size == plan.block_k else "all" if group_size == k else "any"
    split_k, partial, counters = split_k_buffers(split_k, m, n, x.device)
    pdl = launch_options(x.device)  # the GEMVs, the split-K dot and the split sum: decode steps
    args = (
        x, qweight, scales, offsets_arg, out, partial, counters,
        m, n, k, x.stride(0), group_size, steps, split_k,
    )  # fmt: skip
    if plan.kernel == "gemv" and row_gemv_fits(codes, m, n, plan.block_m):
        words = qweight if codes == "int4" else qweight.view(torch.int32)  # int8: [K, N // 4]
        _gemv_row_kernel[(n_blocks, split_k)](
            x, words, scales, offsets_arg, out, partial, counters, m, n, k, x.stride(0),
            group_size, steps, split_k, MAGIC.value, MAGIC.value | 0x80, MAGIC.value | 0x8000,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, GROUPS=groups, STAGES=plan.num_stages,
            LAST_REDUCES=last_reduces, **plan.launch_options(), **pdl, **common,
        )  # fmt: skip
    elif plan.kernel == "lean":
        require(m == 1, f"the lean GEMV takes one row of x, got {m}")
        require(codes == "int4" or n % 4 == 0, f"int8 lean GEMV needs N % 4 == 0, got {n}")
        _check_one_row_steps(plan, group_size, k)
        words = qweight if codes == "int4" else qweight.view(torch.int32)  # int8: [K, N // 4]
        _gemv_lean_kernel[(n_blocks, split_k)](
            x, words, scales, offsets_arg, out, partial, counters, n, k, group_size, steps,
            split_k, *MAGICS, INT8_FLIP, BLOCK_N=plan.block_n, GROUPS=groups,
            STAGES=plan.num_stages, LAST_REDUCES=last_reduces, USE_PRMT=PRMT,
            **plan.launch_options(), **pdl, **common,
        )  # fmt: skip
    elif plan.kernel == "half2":
        require(not INTERPRETED, "the half2 GEMV is inline PTX: the interpreter cannot run it")
        require(m == 1 and codes == "int4", f"the half2 GEMV takes one row of int4, got {m}")
        _check_one_row_steps(plan, group_size, k)
        _gemv_half2_kernel[(n_blocks, split_k)](
            x, qweight, scales, offsets_arg, out, partial, counters, n, k, group_size, steps,
            split_k, HAS_OFFSETS=offsets is not None, BLOCK_N=plan.block_n,
            BLOCK_K=plan.block_k, GROUPS=groups, STAGES=plan.num_stages,
            LAST_REDUCES=last_reduces, **plan.launch_options(), **pdl,
        )  # fmt: skip
    elif plan.kernel == "mma":
        launch_mma(
            x, qweight, scales, offsets, out, partial, counters, group_size, steps, split_k,
            plan, dot_precision(x.dtype),
        )  # fmt: skip
    elif plan.kernel == "gemv":
        _gemv_kernel[(n_blocks, split_k)](
            *args, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, LAST_REDUCES=last_reduces,
            **plan.launch_options(), **common,
        )  # fmt: skip
    else:
        planes = plan.int4_planes and codes == "int4"
        biased = plan.biased_codes and planes and plan.scale_after_dot and x.dtype in CODE_BIAS
        bias, bias_bits = CODE_BIAS[x.dtype] if biased else (0.0, 0)
        _dot_kernel[(m_blocks * n_blocks, split_k)](
            *args, bias_bits, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, GROUP_M=8,
            PLANES=planes, SCALE_AFTER_DOT=plan.scale_after_dot, CODE_BIAS=bias,
            LAST_REDUCES=last_reduces, DOT_PRECISION=dot_precision(x.dtype),
            **plan.launch_options(), **pdl, **common,
        )  # fmt: skip
    if split_k > 1 and not last_reduces:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            partial, out, m * n, split_k, BLOCK=block, **pdl
        )
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
