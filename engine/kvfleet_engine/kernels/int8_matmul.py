"""int8 weight-only products: the integer-weight kernels of `int4_matmul` with 8-bit signed codes
and no offsets (weight = code * scale; one group of K rows for per-output-channel scales)."""

from __future__ import annotations

import torch

from kvfleet_engine.kernels.checks import require
from kvfleet_engine.kernels.int4_matmul import check_operands, launch
from kvfleet_engine.kernels.int_plan import plan_matmul


def int8_matmul(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int8 [K, N]
    scales: torch.Tensor,  # [K // group_size, N]
    group_size: int,
) -> torch.Tensor:
    """x @ (code * scale) -> [M, N] in x's dtype (bias is the caller's)."""
    m, n, k = check_operands(x, qweight, scales, group_size, pack=1)
    require(qweight.dtype == torch.int8, f"qweight must be int8, got {qweight.dtype}")
    return launch(
        x, qweight, scales, None, group_size, plan_matmul(m, n, k, group_size, x.device, "int8")
    )
