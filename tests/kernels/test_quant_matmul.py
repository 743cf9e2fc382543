"""The quantized matrix products against `quant.layout`'s references.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on CPU at small sizes (the
mechanism of test_triton_kernels); the `gpu`-marked cases run them natively on the Llama-3.1-8B
products, torch._scaled_mm included, and inside a CUDA graph.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
import torch
from test_triton_kernels import ON_GPU, _kernel_module

from kvfleet_engine.quant import layout

int4 = _kernel_module("int4_matmul")
int8 = importlib.reload(importlib.import_module("kvfleet_engine.kernels.int8_matmul"))
fp8 = _kernel_module("fp8_matmul")
MatmulPlan = int4.MatmulPlan

DEVICE = "cuda" if ON_GPU else "cpu"
on_cpu = pytest.mark.skipif(ON_GPU, reason="the interpreted cases run where there is no GPU")
# (N, K) of one Llama-3.1-8B decoder layer's products: qkv, o, gate_up, down
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _let_interpreter_round_floats_like_the_gpu() -> None:
    """The interpreter narrows floats to fp8 / bf16 by cutting mantissa bits (halves round up,
    and a carry out of the mantissa is lost: 31.2 becomes 16 in e4m3); the GPU rounds to the
    nearest even, as torch does. Narrow through torch instead."""
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "kvfleet_patched", False):
        return
    torch_dtypes = {
        "fp8e4nv": torch.float8_e4m3fn,
        "fp8e5": torch.float8_e5m2,
        "bf16": torch.bfloat16,
    }

    def patched(input, input_dtype, output_dtype, rounding_mode):
        target = torch_dtypes.get(output_dtype.name)
        if target is None or input.dtype.kind != "f":
            return original(input, input_dtype, output_dtype, rounding_mode)
        narrowed = torch.from_numpy(np.ascontiguousarray(input)).to(target)
        bits = torch.uint8 if narrowed.element_size() == 1 else torch.uint16
        return narrowed.view(bits).numpy().reshape(input.shape)

    patched.kvfleet_patched = True  # type: ignore[attr-defined]
    interpreter._convert_float = patched


if not ON_GPU:
    _let_interpreter_round_floats_like_the_gpu()


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected.float()).norm() / expected.float().norm())


@functools.cache
def make_int4(n: int, k: int, group_size: int, scale_dtype=torch.float16, device=DEVICE, seed=0):
    """A random packed int4 weight [K, N] (built on the device: the 8B products are large)."""
    gen = torch.Generator(device).manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, device=device)
    scales = torch.rand(n, k // group_size, generator=gen, device=device) * 0.02 + 0.001
    noise = torch.randn(n, k // group_size, generator=gen, device=device)
    offsets = -8 * scales * (1 + 0.1 * noise)
    return layout.pack_int4(codes, scales, offsets, group_size, scale_dtype=scale_dtype)


@functools.cache
def make_int8(n: int, k: int, group_size: int | None, device=DEVICE, seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    weight = torch.randn(n, k, generator=gen, device=device) * 0.02
    return layout.quantize_int8(weight, group_size)


def make_x(m: int, k: int, dtype=torch.float32, device=DEVICE, seed=1):
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randn(m, k, generator=gen, device=device).to(dtype)


@functools.cache
def make_fp8(n: int, k: int, device=DEVICE):
    return layout.quantize_fp8(make_x(n, k, device=device, seed=3) * 0.02)


def run_int4(x, weight, plan=None):
    if plan is None:
        return int4.int4_matmul(x, weight.qweight, weight.scales, weight.offsets, weight.group_size)
    return int4.launch(x, weight.qweight, weight.scales, weight.offsets, weight.group_size, plan)


def run_int8(x, weight, plan=None):
    if plan is None:
        return int8.int8_matmul(x, weight.qweight, weight.scales, weight.group_size)
    return int4.launch(x, weight.qweight, weight.scales, None, weight.group_size, plan)


# ---- interpreted, small sizes -------------------------------------------------------------------


@on_cpu
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_int4_matches_reference(group_size, m) -> None:
    n, k = 200, 3 * group_size  # N not a multiple of BLOCK_N; K a few groups
    weight = make_int4(n, k, group_size)
    x = make_x(m, k)
    out = run_int4(x, weight)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert relative_error(out, layout.int4_linear_reference(x, weight)) < 1e-5


# Plans the shape table may pick on the GPU, forced at small sizes: split-K with slices of unequal
# length, the tensor-core GEMV, small GEMM tiles, the dequantize + matmul path.
PLANS = [
    pytest.param(MatmulPlan("gemv", 4, 64, 32, split_k=2), 3, id="gemv-split2"),
    pytest.param(MatmulPlan("gemv", 1, 32, 16, split_k=5), 1, id="gemv-split5"),
    pytest.param(MatmulPlan("gemv", 16, 64, 32, use_dot=True), 9, id="gemv-dot"),
    pytest.param(MatmulPlan("gemv", 16, 64, 32, split_k=3, use_dot=True), 16, id="gemv-dot-split3"),
    pytest.param(MatmulPlan("gemv", 4, 64, 32, 2, int4_codes="int4-rows"), 4, id="gemv-rows"),
    pytest.param(MatmulPlan("gemm", 16, 32, 16), 40, id="gemm-small-tiles"),
    pytest.param(MatmulPlan("gemm", 16, 32, 32, int4_codes="int4-rows"), 20, id="gemm-rows"),
    pytest.param(MatmulPlan("dequantize", 0, 64, 32), 5, id="dequantize"),
]


@on_cpu
@pytest.mark.parametrize(("plan", "m"), PLANS)
def test_int4_plans_match_reference(plan, m) -> None:
    weight = make_int4(72, 96, 32)  # K = 3 groups of 32
    x = make_x(m, 96)
    assert relative_error(run_int4(x, weight, plan), layout.int4_linear_reference(x, weight)) < 1e-5


@on_cpu
@pytest.mark.parametrize(("plan", "m"), PLANS)
def test_int8_plans_match_reference(plan, m) -> None:
    weight = make_int8(72, 96, 32)
    x = make_x(m, 96)
    assert relative_error(run_int8(x, weight, plan), layout.int8_linear_reference(x, weight)) < 1e-5


@on_cpu
@pytest.mark.parametrize("group_size", [None, 32])  # None: per output channel (one group of K)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_int8_matches_reference(group_size, m) -> None:
    weight = make_int8(200, 160, group_size)
    x = make_x(m, 160)
    out = run_int8(x, weight)
    assert out.shape == (m, 200)
    assert relative_error(out, layout.int8_linear_reference(x, weight)) < 1e-5


@on_cpu
@pytest.mark.parametrize("m", [1, 20])
def test_half_precision_activations_and_a_group_of_40(m) -> None:
    """fp16 x with bf16 scales; a group size that is a multiple of 8 but not of 16."""
    weight = make_int4(48, 80, 40, scale_dtype=torch.bfloat16)
    x = make_x(m, 80, dtype=torch.float16)
    out = run_int4(x, weight)
    assert out.dtype == torch.float16
    assert relative_error(out, layout.int4_linear_reference(x, weight)) < 2e-3


@on_cpu
def test_zero_rows_give_an_empty_product() -> None:
    weight = make_int4(48, 64, 32)
    assert run_int4(make_x(0, 64), weight).shape == (0, 48)


@on_cpu
def test_fp8_row_quantization_matches_reference() -> None:
    x = make_x(6, 300, dtype=torch.float16) * 3
    x[2] = 0  # an all-zero row takes the smallest scale, not a division by zero
    x[4, 7] = 1000.0  # one outlier sets its row's scale
    x_q, scale = fp8.quantize_fp8_rows(x)
    expected_q, expected_scale = layout.quantize_fp8_rows(x)
    assert x_q.dtype == layout.FP8_DTYPE and scale.shape == (6, 1)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(x_q.view(torch.uint8), expected_q.view(torch.uint8))


@on_cpu
@pytest.mark.parametrize("m", [1, 20])
def test_triton_fp8_gemm_matches_reference(m) -> None:
    weight = make_fp8(80, 96)
    x = make_x(m, 96, dtype=torch.float16)
    out = fp8.fp8_matmul(x, weight.weight, weight.scale, torch.float16)
    assert out.shape == (m, 80) and out.dtype == torch.float16
    assert relative_error(out, layout.fp8_linear_reference(x, weight)) < 2e-3


BAD_INT4_INPUTS = [
    ("x", lambda x, w: (x[None], w.qweight, w.scales, w.offsets, 32)),
    ("x", lambda x, w: (x.t().contiguous().t(), w.qweight, w.scales, w.offsets, 32)),
    ("qweight", lambda x, w: (x, w.qweight.to(torch.int64), w.scales, w.offsets, 32)),
    ("qweight", lambda x, w: (x, w.qweight[:-1].contiguous(), w.scales, w.offsets, 32)),
    ("group_size", lambda x, w: (x, w.qweight, w.scales, w.offsets, 12)),
    ("scales", lambda x, w: (x, w.qweight, w.scales[:, :-1].contiguous(), w.offsets, 32)),
    ("offsets", lambda x, w: (x, w.qweight, w.scales, w.offsets.float(), 32)),
    ("qweight", lambda x, w: (x, w.qweight.t().contiguous().t(), w.scales, w.offsets, 32)),
]


@on_cpu
@pytest.mark.parametrize(("name", "args"), BAD_INT4_INPUTS)
def test_int4_rejects_bad_operands_naming_them(name, args) -> None:
    weight = make_int4(64, 96, 32)
    with pytest.raises(ValueError, match=name):
        int4.int4_matmul(*args(make_x(4, 96), weight))


@on_cpu
def test_int8_and_fp8_reject_bad_operands_naming_them() -> None:
    weight = make_int8(64, 96, 32)
    x = make_x(2, 96)
    with pytest.raises(ValueError, match="qweight"):
        int8.int8_matmul(x, weight.qweight.to(torch.int32), weight.scales, 32)
    fp8_weight = make_fp8(64, 96)
    with pytest.raises(ValueError, match="x must be bfloat16 or float16"):
        fp8.fp8_matmul(x, fp8_weight.weight, fp8_weight.scale, torch.bfloat16)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8.fp8_matmul(x.half(), fp8_weight.weight, fp8_weight.scale.half(), torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8.fp8_matmul(x.half(), fp8_weight.weight, fp8_weight.scale, torch.float32)


# ---- on the GPU, the Llama-3.1-8B products ------------------------------------------------------


# (group_size, rows): each kernel of the shape table (GEMV at 1 and 8 rows, GEMM tiles of 64 and
# 128 rows, dequantize + cuBLAS at 1024) at group 128, and GEMV / GEMM at group 32
INT4_CASES = [(128, 1), (128, 8), (128, 64), (128, 300), (128, 1024), (32, 1), (32, 300)]
INT8_CASES = [(None, 1), (None, 8), (None, 300), (None, 1024), (32, 1), (32, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize(("group_size", "m"), INT4_CASES)
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_gpu_int4_llama_products(n, k, group_size, m) -> None:
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    weight = make_int4(n, k, group_size)
    x = make_x(m, k, dtype=torch.bfloat16)
    out = run_int4(x, weight)
    assert relative_error(out, layout.int4_linear_reference(x, weight)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize(("group_size", "m"), INT8_CASES)
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_gpu_int8_llama_products(n, k, group_size, m) -> None:
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    weight = make_int8(n, k, group_size)
    x = make_x(m, k, dtype=torch.bfloat16)
    assert relative_error(run_int8(x, weight), layout.int8_linear_reference(x, weight)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", fp8.BACKENDS)
@pytest.mark.parametrize("m", [1, 8, 300])
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_gpu_fp8_llama_products(n, k, m, backend) -> None:
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    weight = make_fp8(n, k)
    x = make_x(m, k, dtype=torch.bfloat16)
    x_q, x_scale = fp8.quantize_fp8_rows(x)
    expected_q, expected_scale = layout.quantize_fp8_rows(x)
    assert torch.equal(x_scale, expected_scale)
    assert torch.equal(x_q.view(torch.uint8), expected_q.view(torch.uint8))
    if backend == "scaled_mm":
        out = fp8.scaled_mm_fp8(x_q, x_scale, weight.weight, weight.scale)
    else:
        out = fp8.triton_fp8_gemm(x_q, x_scale, weight.weight, weight.scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, layout.fp8_linear_reference(x, weight)) < 1e-2
    assert relative_error(fp8.fp8_matmul(x, weight.weight, weight.scale, torch.float16), out) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 200])
def test_gpu_products_replay_in_a_cuda_graph(m) -> None:
    """Captured once, replayed on new activations: the same values as eager calls."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    n, k = 4096, 4096
    w4, w8 = make_int4(n, k, 128), make_int8(n, k, None)
    wf = make_fp8(n, k)
    x = make_x(m, k, dtype=torch.bfloat16)

    def products():
        return (
            run_int4(x, w4),
            run_int8(x, w8),
            fp8.fp8_matmul(x, wf.weight, wf.scale, torch.bfloat16),
        )

    products()  # compiles the kernels outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = products()
    x.copy_(make_x(m, k, dtype=torch.bfloat16, seed=7))
    graph.replay()
    torch.cuda.synchronize()
    for out, eager in zip(captured, products(), strict=True):
        assert torch.equal(out, eager)
