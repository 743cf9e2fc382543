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
from test_triton_kernels import ON_GPU

from kvfleet_engine.quant import layout


def _kernel_modules():
    """The integer and fp8 product modules, made in this run's mode: a module binds the Triton
    helpers of those it imports, so if any kernel is stale all are reloaded, helpers first."""
    names = ["pdl", "activation", "int_codes", "split_k", "int_plan", "int_gemv", "int_dot"]
    names += ["int_mma", "int4_matmul", "int8_matmul", "fp8_gemv", "fp8_rows", "rms_norm"]
    names += ["fp8_matmul"]
    modules = [importlib.import_module(f"kvfleet_engine.kernels.{name}") for name in names]
    kernels = [
        value
        for module in modules
        for key, value in vars(module).items()
        if key.startswith("_") and key.endswith("_kernel")
    ]
    if any((type(k).__name__ == "InterpretedFunction") == ON_GPU for k in kernels):
        modules = [importlib.reload(module) for module in modules]
    return modules


(_, activation, _, splits, int_plan, _, _, _, int4, int8, fp8_gemv, fp8_rows, rms_norm, fp8) = (
    _kernel_modules()
)
MatmulPlan = int_plan.MatmulPlan

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


# Plans the shape table may pick on the GPU, forced at small sizes: the GEMV with split-K slices
# of unequal length summed by the last program or by a second kernel, the tensor-core kernel with
# int4 nibble planes or reshaped codes, scales after the dot or on the weights, with split-K, and
# the dequantize + matmul path.
PLANS = [
    pytest.param(MatmulPlan("gemv", 4, 64, 32, split_k=2), 3, id="gemv-split2"),
    pytest.param(MatmulPlan("gemv", 1, 32, 16, split_k=5), 1, id="gemv-split5"),
    pytest.param(MatmulPlan("gemv", 2, 64, 32, 3, "kernel"), 2, id="gemv-split3-kernel-sums"),
    pytest.param(MatmulPlan("dot", 16, 64, 32, int4_planes=False), 9, id="dot-reshape"),
    pytest.param(MatmulPlan("dot", 16, 64, 32, split_k=3), 16, id="dot-split3"),
    pytest.param(MatmulPlan("dot", 16, 32, 32, 2, "kernel"), 5, id="dot-split2-kernel-sums"),
    pytest.param(MatmulPlan("dot", 16, 32, 32, scale_after_dot=False), 40, id="dot-scaled-weights"),
    pytest.param(MatmulPlan("dequantize", 0, 64, 32), 5, id="dequantize"),
]
# int4 nibble planes need 16 packed rows per dot: a K step of 128 (one group of 128)
PLANES = [
    pytest.param(MatmulPlan("dot", 16, 32, 128), 7, id="planes"),
    pytest.param(MatmulPlan("dot", 16, 32, 128, split_k=3), 16, id="planes-split3"),
    pytest.param(MatmulPlan("dot", 32, 32, 128, scale_after_dot=False), 40, id="planes-scaled"),
    pytest.param(MatmulPlan("gemv", 2, 32, 128, split_k=2), 2, id="gemv-group-step"),
    pytest.param(MatmulPlan("gemv", 1, 32, 128, split_k=2), 1, id="row-gemv-group-step"),
    pytest.param(MatmulPlan("gemv", 1, 64, 64, 3, "kernel"), 1, id="row-gemv-half-groups"),
    pytest.param(MatmulPlan("gemv", 2, 32, 128, 2, num_stages=3), 2, id="row-gemv-2-rows"),
    pytest.param(MatmulPlan("gemv", 4, 64, 64, 3, num_stages=3), 3, id="row-gemv-3-of-4-rows"),
]


@on_cpu
@pytest.mark.parametrize(("plan", "m"), PLANES)
def test_int4_planes_match_reference(plan, m) -> None:
    weight = make_int4(40, 384, 128)  # K = 3 groups of 128
    x = make_x(m, 384)
    assert relative_error(run_int4(x, weight, plan), layout.int4_linear_reference(x, weight)) < 1e-5


@on_cpu
@pytest.mark.parametrize("split_k", [1, 3])
def test_int4_biased_codes_match_reference(split_k) -> None:
    """16-bit x: codes enter the dot as code + 1024 (fp16; bf16: + 128, on the GPU only: the
    interpreter's bf16 dots multiply raw bits) made from their bits; the bias comes off with the
    group's Σx, so the product is the reference's (to the rounding of x's dtype)."""
    weight = make_int4(40, 384, 128)
    x = make_x(5, 384, dtype=torch.float16)
    plan = MatmulPlan("dot", 16, 32, 128, split_k, biased_codes=True)
    expected = layout.int4_linear_reference(x, weight)
    assert relative_error(run_int4(x, weight, plan), expected) < 5e-3


@on_cpu
@pytest.mark.parametrize("m", [1, 2, 4])
def test_int4_row_gemv_with_one_group_of_k(m) -> None:
    """Scales per output channel (one group of all K rows: scaled once, at the end), over
    pipelined K steps."""
    weight = make_int4(40, 256, 256)
    x = make_x(m, 256)
    plan = MatmulPlan("gemv", m, 32, 32, split_k=1, num_stages=3)
    assert relative_error(run_int4(x, weight, plan), layout.int4_linear_reference(x, weight)) < 1e-5


@on_cpu
def test_split_k_counters_are_zero_after_each_product() -> None:
    """The last program of each tile resets its counter, so the next product starts from 0."""
    weight = make_int4(72, 96, 32)
    x = make_x(3, 96)
    plan = MatmulPlan("gemv", 4, 32, 16, split_k=4)
    first = run_int4(x, weight, plan)
    assert int(splits._counters(x.device).abs().sum()) == 0
    assert torch.equal(run_int4(x, weight, plan), first)


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
@pytest.mark.parametrize(
    "plan",
    [MatmulPlan("dot", 16, 64, 32, split_k=3), MatmulPlan("dot", 16, 32, 32, 2, "kernel")],
    ids=["split3", "split2-kernel-sums"],
)
def test_int8_per_channel_one_row_dot_matches_reference(plan) -> None:
    """The split-K dot with one scale per output channel (the shape rules' kernel for int8
    decode batches of products the plan table does not list): the group ends only where each
    slice of K does."""
    weight = make_int8(72, 96, None)
    x = make_x(1, 96)
    assert relative_error(run_int8(x, weight, plan), layout.int8_linear_reference(x, weight)) < 1e-5


@on_cpu
@pytest.mark.parametrize("group_size", [None, 32])  # None: per output channel (one group of K)
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n", [200, 198])  # one row: int32 words of 4 columns, or bytes
def test_int8_matches_reference(group_size, m, n) -> None:
    weight = make_int8(n, 160, group_size)
    x = make_x(m, 160)
    out = run_int8(x, weight)
    assert out.shape == (m, n)
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
    assert x_q.dtype == layout.FP8_DTYPE and scale.shape == (6, 1)
    assert_row_quantization(x, x_q, scale)


@on_cpu
def test_fp8_rows_wider_than_registers_take_two_passes(monkeypatch) -> None:
    """A row wider than ROW_MAX_COLS is read twice (max, then codes): the same codes."""
    monkeypatch.setattr(fp8_rows, "ROW_MAX_COLS", 128)
    x = make_x(3, 300, dtype=torch.bfloat16) * 3
    x[1, 299] = -500.0  # the max in the last, partial block
    x_q, scale = fp8_rows.quantize_fp8_rows(x)
    assert_row_quantization(x, x_q, scale)


@on_cpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_fp8_equals_the_two_kernels_it_fuses(dtype) -> None:
    """The down projection's e4m3 rows made with the activation are, bit for bit, those of
    silu_and_mul then quantize_fp8_rows (inner 300: a masked tail)."""
    gate_up = make_x(5, 600, dtype=dtype) * 4
    gate_up[3] = 0  # a zero row: the smallest scale
    x_q, scale = fp8_rows.silu_and_mul_fp8(gate_up)
    expected_q, expected_scale = fp8_rows.quantize_fp8_rows(activation.silu_and_mul(gate_up))
    assert x_q.shape == (5, 300) and scale.shape == (5, 1)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(x_q.view(torch.uint8), expected_q.view(torch.uint8))
    assert_row_quantization(activation.silu_and_mul(gate_up), x_q, scale)


@on_cpu
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_out_equals_quantizing_its_output(with_residual) -> None:
    """The norm's e4m3 rows are those of quantize_fp8_rows of its 16-bit output, bit for bit;
    the residual sum comes out as without fp8_out (dim 200: a masked tail)."""
    x, residual = make_x(6, 200, dtype=torch.bfloat16) * 3, make_x(6, 200, torch.bfloat16, seed=2)
    weight = make_x(1, 200, dtype=torch.bfloat16, seed=3)[0]
    added = residual if with_residual else None
    rows, summed = rms_norm.rms_norm(x, weight, 1e-5, added, fp8_out=True)
    out, expected_summed = rms_norm.rms_norm(x, weight, 1e-5, added)
    expected = fp8_rows.quantize_fp8_rows(out)
    assert isinstance(rows, fp8_rows.Fp8Rows) and rows.codes.shape == (6, 200)
    assert torch.equal(rows.scale, expected.scale)
    assert torch.equal(rows.codes.view(torch.uint8), expected.codes.view(torch.uint8))
    assert summed is None if not with_residual else torch.equal(summed, expected_summed)


@on_cpu
@pytest.mark.parametrize("m", [3, fp8_gemv.GEMV_MAX_ROWS + 1, 40])  # the GEMV, then W8A8
def test_fp8_silu_and_mul_matmul_equals_the_unfused_product(m) -> None:
    weight = make_fp8(80, 96)
    gate_up = make_x(m, 192, dtype=torch.float16)
    out = fp8.fp8_silu_and_mul_matmul(gate_up, weight.weight, weight.scale, torch.float16)
    activated = activation.silu_and_mul(gate_up)
    assert torch.equal(out, fp8.fp8_matmul(activated, weight.weight, weight.scale, torch.float16))
    with pytest.raises(ValueError, match="weight must be \\[N, 95\\]"):
        fp8.fp8_silu_and_mul_matmul(gate_up[:, :190], weight.weight, weight.scale, torch.float16)


@on_cpu
def test_fp8_silu_and_mul_matmul_wider_than_registers_quantizes_apart(monkeypatch) -> None:
    """An activation wider than one program's registers is made, then quantized in two passes:
    the same product (the fused kernel refuses such rows)."""
    monkeypatch.setattr(fp8_rows, "ROW_MAX_COLS", 64)
    weight = make_fp8(80, 96)
    gate_up = make_x(20, 192, dtype=torch.bfloat16)
    out = fp8.fp8_silu_and_mul_matmul(gate_up, weight.weight, weight.scale, torch.bfloat16)
    activated = activation.silu_and_mul(gate_up)
    assert torch.equal(out, fp8.fp8_matmul(activated, weight.weight, weight.scale, torch.bfloat16))
    with pytest.raises(ValueError, match=r"inner size 96 is not in 1\.\.64"):
        fp8_rows.silu_and_mul_fp8(gate_up)


def assert_row_quantization(x: torch.Tensor, x_q: torch.Tensor, scale: torch.Tensor) -> None:
    """scale is amax / 448 correctly rounded (computed in float64, then rounded once: torch's
    CUDA `tensor / 448.0` multiplies by a rounded reciprocal and may be 1 ulp off), and x_q is
    x / scale rounded to e4m3 bit for bit."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    assert torch.equal(scale, (amax.double() / layout.FP8_MAX).float())
    expected_q = (x.float() / scale).clamp(-layout.FP8_MAX, layout.FP8_MAX).to(layout.FP8_DTYPE)
    assert torch.equal(x_q.view(torch.uint8), expected_q.view(torch.uint8))


@on_cpu
@pytest.mark.parametrize("m", [fp8_gemv.GEMV_MAX_ROWS + 1, 40])  # W8A8: rows above the GEMV's
def test_triton_fp8_gemm_matches_reference(m) -> None:
    weight = make_fp8(80, 96)
    x = make_x(m, 96, dtype=torch.float16)
    out = fp8.fp8_matmul(x, weight.weight, weight.scale, torch.float16)
    assert out.shape == (m, 80) and out.dtype == torch.float16
    assert relative_error(out, layout.fp8_linear_reference(x, weight)) < 2e-3


FP8_GEMV_BLOCKS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, split_k, use_dot, reduce), rows
    pytest.param(None, 1, id="auto-1-row"),
    pytest.param(None, 5, id="auto-5-rows"),
    pytest.param((4, 32, 64, 4, 3, False, "last"), 3, id="split3-unequal"),
    pytest.param((2, 16, 32, 4, 4, False, "kernel"), 2, id="split4-kernel-sums"),
    pytest.param((16, 32, 64, 4, 2, True, "last"), 9, id="dot-split2"),
]


@on_cpu
@pytest.mark.parametrize(("blocks", "m"), FP8_GEMV_BLOCKS)
def test_fp8_weight_only_gemv_matches_reference(blocks, m) -> None:
    """Decode rows skip activation quantization: the product of x itself (K not a multiple of
    BLOCK_K, so the last step is masked)."""
    weight = make_fp8(80, 200)
    x = make_x(m, 200, dtype=torch.float16)
    out = fp8_gemv.fp8_gemv(x, weight.weight, weight.scale, torch.float16, blocks)
    assert out.shape == (m, 80) and out.dtype == torch.float16
    assert relative_error(out, layout.fp8_weight_only_reference(x.float(), weight)) < 1e-3
    if blocks is None:  # what fp8_matmul runs at decode sizes (its checks, then this)
        assert torch.equal(fp8.fp8_matmul(x, weight.weight, weight.scale, torch.float16), out)


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


# (group_size, rows): each kernel of the shape table (GEMV at 1 row, split-K dot at 4, 8 and 16,
# dequantize + cuBLAS from 17) at group 128, the 2-D GEMV at 4 rows and dot tiles of 64 and 128
# rows as the sweeps run them, and GEMV / dot at group 32
INT4_CASES = [(128, 1), (128, 4), (128, 8), (128, 16), (128, 17), (128, 300)]
INT4_CASES += [(32, 1), (32, 8), (32, 300)]
INT8_CASES = [(None, 1), (None, 4), (None, 16), (None, 300), (32, 1), (32, 8)]
SWEPT_PLANS = [  # (plan, rows): candidates bench.quant_sweep times besides the table's picks
    pytest.param(MatmulPlan("gemv", 1, 128, 64, 8, num_stages=3), 1, id="gemv-pipelined"),
    pytest.param(MatmulPlan("gemv", 4, 128, 64, 8, num_stages=3), 4, id="gemv-4-rows"),
    pytest.param(MatmulPlan("dot", 16, 128, 128, 4, int4_planes=False), 16, id="dot-reshape"),
    pytest.param(MatmulPlan("dot", 16, 128, 128, 4, biased_codes=True), 16, id="dot-biased"),
    pytest.param(
        MatmulPlan("dot", 128, 128, 64, int4_planes=False, scale_after_dot=False, num_warps=8),
        300,
        id="dot-128x128x64",
    ),
    pytest.param(MatmulPlan("dot", 64, 128, 128, num_warps=4), 64, id="dot-64x128x128-planes"),
]


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
@pytest.mark.parametrize("codes", ["int4", "int8"])
@pytest.mark.parametrize(("plan", "m"), SWEPT_PLANS)
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_gpu_swept_plans_llama_products(n, k, plan, m, codes) -> None:
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    x = make_x(m, k, dtype=torch.bfloat16)
    if codes == "int4":
        weight = make_int4(n, k, 128)
        expected = layout.int4_linear_reference(x, weight)
        out = run_int4(x, weight, plan)
    else:
        weight8 = make_int8(n, k, None)
        expected = layout.int8_linear_reference(x, weight8)
        out = run_int8(x, weight8, plan)
    assert relative_error(out, expected) < 1e-2


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
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, fp8_gemv.GEMV_MAX_ROWS, fp8_gemv.GEMV_MAX_ROWS + 1, 300])
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_gpu_fp8_matmul_llama_products(n, k, m, out_dtype) -> None:
    """fp8_matmul against the reference of the path it takes: up to GEMV_MAX_ROWS rows the
    weight-only product of x itself (x not rounded: tighter than W8A8 can be, whose rounding of
    x to e4m3 costs about 3%), above them W8A8."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    weight = make_fp8(n, k)
    x = make_x(m, k, dtype=torch.bfloat16)
    out = fp8.fp8_matmul(x, weight.weight, weight.scale, out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    if m <= fp8_gemv.GEMV_MAX_ROWS:
        assert relative_error(out, layout.fp8_weight_only_reference(x.float(), weight)) < 5e-3
    else:
        assert relative_error(out, layout.fp8_linear_reference(x, weight)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", fp8.BACKENDS)
@pytest.mark.parametrize("m", [1, 8, 300])
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_gpu_fp8_w8a8_llama_products(n, k, m, backend) -> None:
    """Each W8A8 backend at decode and prompt rows: x quantized per token bit for bit, the
    product as `fp8_linear_reference`."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    weight = make_fp8(n, k)
    x = make_x(m, k, dtype=torch.bfloat16)
    x_q, x_scale = fp8.quantize_fp8_rows(x)
    assert_row_quantization(x, x_q, x_scale)
    if backend == "scaled_mm":
        out = fp8.scaled_mm_fp8(x_q, x_scale, weight.weight, weight.scale)
    else:
        out = fp8.triton_fp8_gemm(x_q, x_scale, weight.weight, weight.scale, torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert relative_error(out, layout.fp8_linear_reference(x, weight)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 300, 4096])
def test_gpu_fp8_silu_and_mul_matmul_llama_down(m) -> None:
    """The down projection of Llama-3.1-8B from [gate | up]: the fused activation's e4m3 rows
    equal the unfused kernels' bit for bit, so the products are equal."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    weight = make_fp8(4096, 14336)
    gate_up = make_x(m, 2 * 14336, dtype=torch.bfloat16) * 2
    x_q, scale = fp8_rows.silu_and_mul_fp8(gate_up)
    activated = activation.silu_and_mul(gate_up)
    expected_q, expected_scale = fp8_rows.quantize_fp8_rows(activated)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(x_q.view(torch.uint8), expected_q.view(torch.uint8))
    out = fp8.fp8_silu_and_mul_matmul(gate_up, weight.weight, weight.scale, torch.bfloat16)
    assert torch.equal(out, fp8.fp8_matmul(activated, weight.weight, weight.scale, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("m", [17, 4096])
def test_gpu_rms_norm_fp8_out_llama(m, with_residual) -> None:
    """Llama-3.1-8B's norm (4,096 columns) writing e4m3 rows: those of quantizing its 16-bit
    output, but where the two compiled variants round the row's sum of squares apart (each
    lays the row out over its threads for its own stores, so it may sum in its own order; on an
    H100 codes differed at 4,096 rows, none at 17): there the code is the next e4m3 value, never
    further. The residual sum is the same either way."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    x = make_x(m, 4096, dtype=torch.bfloat16) * 3
    residual = make_x(m, 4096, dtype=torch.bfloat16, seed=2)
    weight = make_x(1, 4096, dtype=torch.bfloat16, seed=3)[0]
    added = residual if with_residual else None
    rows, summed = rms_norm.rms_norm(x, weight, 1e-5, added, fp8_out=True)
    out, expected_summed = rms_norm.rms_norm(x, weight, 1e-5, added)
    expected = fp8_rows.quantize_fp8_rows(out)
    torch.testing.assert_close(rows.scale, expected.scale, rtol=2**-7, atol=0)
    steps = (rows.codes.view(torch.uint8).int() - expected.codes.view(torch.uint8).int()).abs()
    apart = (steps > 0).float().mean().item()
    assert steps.max().item() <= 1 and apart < 1e-3, f"max step {steps.max()}, {apart:.2e} apart"
    assert summed is None if not with_residual else torch.equal(summed, expected_summed)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336, fp8_rows.ROW_MAX_COLS + 3000])  # the last: 2 passes
def test_gpu_fp8_row_quantization_one_and_two_passes(k) -> None:
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    x = make_x(33, k, dtype=torch.bfloat16) * 3
    x[5] = 0
    x[7, k - 1] = -900.0  # the max in the last, partial block
    x_q, scale = fp8_rows.quantize_fp8_rows(x)
    assert_row_quantization(x, x_q, scale)


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
