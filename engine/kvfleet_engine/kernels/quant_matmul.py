"""The quantized matrix products the quantized linears call on CUDA (bias is the caller's):

    int4_matmul(x [M, K] (gathered by perm), qweight, scales, offsets, group_size) -> [M, N]
    int8_matmul(x [M, K], qweight, scales, group_size) -> [M, N]
    fp8_matmul(x [M, K], weight_fp8 [N, K], weight_scale [N], out_dtype) -> [M, N]
    fp8_silu_and_mul_matmul([gate | up] [M, 2 K], weight_fp8, weight_scale, out_dtype) -> [M, N]
    fp8_rows_matmul(Fp8Rows (e4m3 [M, K], scales [M, 1]), weight_fp8, weight_scale, out_dtype)

Layouts are `quant.layout`'s; each wrapper checks its operands and launches only on shapes (no
host syncs), so all three run inside CUDA-graph capture.
"""

from kvfleet_engine.kernels.fp8_matmul import (
    fp8_matmul,
    fp8_rows_matmul,
    fp8_silu_and_mul_matmul,
)
from kvfleet_engine.kernels.int4_matmul import int4_matmul
from kvfleet_engine.kernels.int8_matmul import int8_matmul

__all__ = [
    "fp8_matmul",
    "fp8_rows_matmul",
    "fp8_silu_and_mul_matmul",
    "int4_matmul",
    "int8_matmul",
]
