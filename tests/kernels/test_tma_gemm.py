"""The persistent TMA GEMM (kernels/tma_gemm.py) against torch's product: under the interpreter
on the CPU at small sizes (rows and columns that fill no tile evenly, several tiles per
program), natively on a GPU at the Llama-3.1-8B layer's sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_triton_kernels import ON_GPU, _kernel_module

tma = _kernel_module("tma_gemm")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.skipif(ON_GPU, reason="the interpreted cases run where there is no GPU")
@pytest.mark.parametrize("m", [1, 40, 72])
def test_tma_gemm_matches_the_product_under_the_interpreter(m) -> None:
    torch.manual_seed(m)
    x = torch.randn(m, 72, dtype=torch.float16)
    weight = torch.randn(56, 72, dtype=torch.float16)
    got = tma.tma_gemm(x, weight, (16, 16, 32, 4, 2), num_programs=3)  # 3..15 tiles
    assert got.shape == (m, 56) and got.dtype == torch.float16
    assert _relative_error(got, x.float() @ weight.float().T) < 2e-3


def test_tma_gemm_refuses_what_its_descriptors_cannot_hold() -> None:
    x = torch.zeros(4, 12, dtype=torch.bfloat16)  # rows of 24 bytes: not a multiple of 16
    assert not tma.tma_gemm_fits(x, torch.zeros(8, 12, dtype=torch.bfloat16))
    assert not tma.tma_gemm_fits(x[:, :8], torch.zeros(8, 8, dtype=torch.bfloat16))  # strided
    assert not tma.tma_gemm_fits(torch.zeros(4, 8), torch.zeros(8, 8))  # float32
    with pytest.raises(ValueError, match="multiples of 8"):
        tma.tma_gemm(x, torch.zeros(8, 12, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 256, 300])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("blocks", [(64, 128, 64, 4, 4), (128, 256, 64, 8, 3)])
def test_gpu_tma_gemm_matches_cublas_on_the_8b_products(m, n, k, blocks) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    assert _relative_error(tma.tma_gemm(x, weight, blocks), F.linear(x, weight)) < 1e-2
