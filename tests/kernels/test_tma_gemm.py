"""The persistent TMA GEMM (kernels/tma_gemm.py) against torch's product: under the interpreter
on the CPU at small sizes (rows and columns that fill no tile evenly, several tiles per
program), natively on a GPU at the Llama-3.1-8B layer's sizes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_triton_kernels import ON_GPU, _kernel_module

from kvfleet_engine.kernels import int_plan

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


def test_tma_gemm_refuses_operands_off_a_16_byte_boundary() -> None:
    """A contiguous view that starts 2 bytes into its storage (TensorDescriptor asserts a
    16-byte aligned base), a row stride of no multiple of 16 bytes, or an empty dimension (it
    asserts positive shapes): refused by tma_gemm_fits, so a planned Linear keeps F.linear."""
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    shifted = torch.zeros(1 + 4 * 16, dtype=torch.bfloat16)[1:].view(4, 16)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 2
    assert not tma.tma_gemm_fits(shifted, weight)
    assert not tma.tma_gemm_fits(torch.zeros(4, 16, dtype=torch.bfloat16), weight[:0])  # N = 0
    assert not tma.tma_gemm_fits(torch.zeros(4, 0, dtype=torch.bfloat16), weight[:, :0])  # K = 0
    with pytest.raises(ValueError, match="16-byte aligned"):
        tma.tma_gemm(shifted, weight)
    # One row cut from a wider one: torch calls it contiguous whatever its row stride (20
    # elements, 40 bytes here), the descriptor takes that stride and asserts it.
    one_row = torch.zeros(1, 20, dtype=torch.bfloat16)[:, :16]
    assert one_row.is_contiguous() and one_row.stride(0) == 20
    assert not tma.tma_gemm_fits(one_row, weight)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 256, 300])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("blocks", [(64, 128, 64, 4, 4), (128, 256, 64, 8, 3)])
def test_gpu_tma_gemm_matches_cublas_on_the_8b_products(m, n, k, blocks) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    assert _relative_error(tma.tma_gemm(x, weight, blocks), F.linear(x, weight)) < 1e-2


def test_a_plan_file_lists_the_shapes_that_take_the_tma_gemm(monkeypatch, tmp_path) -> None:
    plans = tmp_path / "tma-plans.json"
    entry = {"kind": "bf16-tma", "rows": 256, "n": 56, "k": 72}
    tma_256 = {**entry, "plan": {"blocks": [64, 128, 64, 4, 4]}}
    cublas = {**entry, "rows": 128, "plan": {"blocks": None}}  # the probe found cuBLAS faster
    tma_64 = {**entry, "rows": 64, "plan": {"blocks": [64, 64, 64, 4, 3]}}
    plans.write_text(json.dumps({"plans": [tma_256, cublas, tma_64]}))
    monkeypatch.setattr(tma, "TMA_TABLE", {})
    monkeypatch.setenv(int_plan.PLANS_ENV, str(plans))
    int_plan.load_env_plans.cache_clear()
    weight = torch.zeros(56, 72, dtype=torch.bfloat16)
    rows = {
        m: tma.planned_blocks(torch.zeros(m, 72, dtype=torch.bfloat16), weight)
        for m in (1, 64, 65, 128, 129, 256, 257)
    }
    assert rows == {
        1: (64, 64, 64, 4, 3),
        64: (64, 64, 64, 4, 3),
        65: None,  # up to 128 rows cuBLAS was faster
        128: None,
        129: (64, 128, 64, 4, 4),
        256: (64, 128, 64, 4, 4),
        257: None,
    }
    assert (
        tma.planned_blocks(
            torch.zeros(8, 72, dtype=torch.bfloat16), torch.zeros(48, 72, dtype=torch.bfloat16)
        )
        is None
    )  # another shape
    with pytest.raises(ValueError, match="needs blocks"):
        int_plan.install_plans([{**entry, "plan": {"tile": 1}}])
    monkeypatch.delenv(int_plan.PLANS_ENV)
    int_plan.load_env_plans.cache_clear()


@pytest.mark.gpu
def test_gpu_a_planned_linear_runs_the_tma_gemm(monkeypatch, tmp_path) -> None:
    from kvfleet_engine.layers.linear import Linear

    plans = tmp_path / "tma-plans.json"
    entry = {"kind": "bf16-tma", "rows": 256, "n": 4096, "k": 4096}
    plans.write_text(json.dumps([{**entry, "plan": {"blocks": [64, 128, 64, 4, 4]}}]))
    monkeypatch.setattr(tma, "TMA_TABLE", {})
    monkeypatch.setenv(int_plan.PLANS_ENV, str(plans))
    int_plan.load_env_plans.cache_clear()
    layer = Linear(4096, 4096).to(device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=4096**-0.5)
    x = torch.randn(200, 4096, device="cuda", dtype=torch.bfloat16)
    launched = []
    monkeypatch.setattr(
        tma, "tma_gemm", lambda *args: launched.append(args[2]) or F.linear(*args[:2])
    )
    layer(x)
    assert launched == [(64, 128, 64, 4, 4)]
    monkeypatch.delenv(int_plan.PLANS_ENV)
    int_plan.load_env_plans.cache_clear()
