"""The fused-dequantize tensor-core kernel (`kernels.int_mma`, plan kernel "mma") and the plan
table against `quant.layout`'s references: interpreted on the CPU at small sizes (float32 and
float16 x; the interpreter's bfloat16 dots multiply raw bits, so bfloat16 runs on the GPU
only), natively on the Llama-3.1-8B products with the `gpu` mark."""

from __future__ import annotations

import json

import pytest
import torch
from test_quant_matmul import (
    DEVICE,
    LLAMA_8B,
    ON_GPU,
    MatmulPlan,
    int4,
    int_plan,
    make_int4,
    make_int8,
    make_x,
    on_cpu,
    relative_error,
    run_int4,
    run_int8,
)

from kvfleet_engine.quant import layout

MMA_INT4 = [  # (plan, group_size, rows)
    pytest.param(MatmulPlan("mma", 16, 32, 128), 128, 1, id="planes-1-row"),
    pytest.param(MatmulPlan("mma", 16, 32, 128, 3), 128, 5, id="planes-split3"),
    pytest.param(MatmulPlan("mma", 16, 32, 128, 2, swap_ab=True), 128, 16, id="planes-swap"),
    pytest.param(MatmulPlan("mma", 16, 32, 128, 2, "kernel"), 384, 3, id="planes-one-group"),
    pytest.param(MatmulPlan("mma", 32, 32, 32, unpack="reshape"), 32, 40, id="reshape-step"),
    pytest.param(
        MatmulPlan("mma", 16, 64, 32, 3, unpack="reshape", swap_ab=True), 128, 17, id="swap-any"
    ),
    pytest.param(MatmulPlan("mma", 32, 32, 64, unpack="reshape"), 128, 33, id="reshape-any"),
]


@on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("plan", "group_size", "m"), MMA_INT4)
def test_int4_mma_matches_reference(plan, group_size, m, dtype) -> None:
    """float16 x: codes enter the dot as 1024 + code built from their bits, two per mask."""
    weight = make_int4(72, 384, group_size)  # N not a multiple of BLOCK_N
    x = make_x(m, 384, dtype=dtype)
    expected = layout.int4_linear_reference(x.float(), weight)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert relative_error(run_int4(x, weight, plan), expected) < tolerance


MMA_INT8 = [  # (plan, group_size, rows)
    pytest.param(MatmulPlan("mma", 16, 32, 32), None, 1, id="per-channel"),
    pytest.param(MatmulPlan("mma", 16, 32, 32, 3, swap_ab=True), None, 6, id="split3-swap"),
    pytest.param(MatmulPlan("mma", 32, 32, 32, 2), 32, 20, id="group32-split2"),
    pytest.param(MatmulPlan("mma", 16, 16, 16, int8_cast=True), 64, 4, id="cast-group64"),
]


@on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("plan", "group_size", "m"), MMA_INT8)
def test_int8_mma_matches_reference(plan, group_size, m, dtype) -> None:
    """float16 dots: each signed code enters as 1152 + code (the byte XOR 0x6480)."""
    weight = make_int8(48, 192, group_size)
    x = make_x(m, 192, dtype=dtype)
    expected = layout.int8_linear_reference(x.float(), weight)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert relative_error(run_int8(x, weight, plan), expected) < tolerance


LEAN = [  # (codes, plan, group_size): the one-row GEMV with one LOP3 / PRMT and one FFMA a code
    pytest.param("int4", MatmulPlan("lean", 1, 32, 32, 3), 32, id="int4-step-split3"),
    pytest.param("int4", MatmulPlan("lean", 1, 64, 32, 2, "kernel"), 128, id="int4-any"),
    pytest.param("int4", MatmulPlan("lean", 1, 32, 64, num_stages=2), 384, id="int4-one-group"),
    pytest.param("int8", MatmulPlan("lean", 1, 32, 16, 3), None, id="int8-per-channel"),
    pytest.param("int8", MatmulPlan("lean", 1, 64, 32, 2), 64, id="int8-group64"),
]


@on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("codes", "plan", "group_size"), LEAN)
def test_lean_gemv_matches_reference(codes, plan, group_size, dtype) -> None:
    """Codes read as 1 + code · 2^(b - 23) (the biases taken off per group): float32 accumulation
    keeps the error (~3e-4 relative) well below bfloat16 rounding, every nibble and signed byte."""
    x = make_x(1, 384, dtype=dtype) * 30  # large activations: the biases are x · 2^15
    if codes == "int4":
        weight = make_int4(72, 384, group_size)
        expected = layout.int4_linear_reference(x.float(), weight)
        out = run_int4(x, weight, plan)
    else:
        weight = make_int8(48, 384, group_size)
        expected = layout.int8_linear_reference(x.float(), weight)
        out = run_int8(x, weight, plan)
    tolerance = 1e-3 if dtype == torch.float32 else 8e-3  # measured ~3e-4: 1/10 of bf16 rounding
    assert relative_error(out, expected) < tolerance


HALF2 = [  # (plan, group_size, n, k): the one-row int4 GEMV in float16 pairs (inline PTX)
    pytest.param(MatmulPlan("half2", 1, 32, 32, 3), 32, 72, 384, id="step-split3"),
    pytest.param(MatmulPlan("half2", 1, 64, 32, 2, "kernel"), 128, 72, 384, id="any"),
    pytest.param(MatmulPlan("half2", 1, 32, 64, num_stages=2), 384, 72, 384, id="one-group"),
    pytest.param(MatmulPlan("half2", 1, 512, 32, 18, num_warps=1), 128, 28672, 4096, id="gate-up"),
    pytest.param(MatmulPlan("half2", 1, 256, 64, 8, num_warps=2), 128, 4096, 14336, id="down"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize(("plan", "group_size", "n", "k"), HALF2)
def test_half2_gemv_matches_reference(plan, group_size, n, k, outliers, dtype) -> None:
    """float16 partial sums of at most a group's codes per 8-row column, x / 16: bfloat16-level
    error, and activations of thousands (a few channels, as LLMs' massive activations) stay
    finite."""
    weight = make_int4(n, k, group_size)
    x = make_x(1, k, dtype=dtype) * 3
    if outliers:
        x[0, :: k // 4] = 3000.0
    expected = layout.int4_linear_reference(x.float(), weight)
    out = run_int4(x, weight, plan)
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) < 8e-3


@on_cpu
def test_half2_gemv_is_refused_by_the_interpreter_and_skipped_by_the_table(
    empty_plan_table,
) -> None:
    weight = make_int4(64, 256, 128)
    with pytest.raises(ValueError, match="half2 GEMV is inline PTX"):
        run_int4(make_x(1, 256), weight, MatmulPlan("half2", 1, 32, 64))
    entry = {"kind": "int4", "group_size": 128, "rows": 1, "n": 64, "k": 256}
    int_plan.install_plans([entry | {"plan": {"kernel": "half2", "block_m": 1, "block_n": 32,
                                              "block_k": 64}}])  # fmt: skip
    assert int_plan.plan_matmul(1, 64, 256, 128, torch.device("cpu")).kernel == "gemv"


@on_cpu
def test_lean_gemv_rejects_more_rows() -> None:
    weight = make_int4(64, 256, 128)
    with pytest.raises(ValueError, match="lean GEMV takes one row of x, got 2"):
        run_int4(make_x(2, 256), weight, MatmulPlan("lean", 1, 32, 64))


@on_cpu
def test_mma_rejects_blocks_it_cannot_run() -> None:
    weight = make_int4(64, 256, 128)
    x = make_x(2, 256)
    with pytest.raises(ValueError, match="planes need block_k >= 128"):
        run_int4(x, weight, MatmulPlan("mma", 16, 32, 64))
    with pytest.raises(ValueError, match="block_k 256 must divide"):
        run_int4(x, weight, MatmulPlan("mma", 16, 32, 256, unpack="reshape"))
    with pytest.raises(ValueError, match="mma blocks must be >= 16"):
        run_int4(x, weight, MatmulPlan("mma", 8, 32, 128))


@pytest.fixture
def empty_plan_table(monkeypatch):
    monkeypatch.setattr(int_plan, "PLAN_TABLE", {})
    int_plan.load_env_plans.cache_clear()
    yield int_plan.PLAN_TABLE
    int_plan.load_env_plans.cache_clear()


def test_plan_table_entries_pick_the_plan_for_up_to_their_rows(empty_plan_table) -> None:
    mma = {"kernel": "mma", "block_m": 16, "block_n": 32, "block_k": 128, "split_k": 2}
    gemv = {"kernel": "gemv", "block_m": 1, "block_n": 64, "block_k": 64, "split_k": 4}
    int_plan.install_plans(
        [
            {"kind": "int4", "group_size": 128, "rows": 16, "n": 72, "k": 384, "plan": mma},
            {"kind": "int4", "group_size": 128, "rows": 2, "n": 72, "k": 384, "plan": gemv},
        ]
    )
    cpu = torch.device("cpu")
    assert int_plan.plan_matmul(1, 72, 384, 128, cpu) == MatmulPlan(**gemv)
    assert int_plan.plan_matmul(2, 72, 384, 128, cpu).block_m == 2  # gemv: rows padded to 2^i
    assert int_plan.plan_matmul(9, 72, 384, 128, cpu) == MatmulPlan(**mma)
    default = int_plan.plan_matmul(17, 72, 384, 128, cpu)
    assert default.kernel == "dequantize"  # past the table's rows: the built-in rules
    assert int_plan.plan_matmul(9, 72, 384, 32, cpu).kernel == "dot"  # another group size


def test_plan_table_loads_the_sweep_json_named_by_the_environment(
    empty_plan_table, tmp_path, monkeypatch
) -> None:
    plan = {"kernel": "mma", "block_m": 16, "block_n": 32, "block_k": 32, "unpack": "reshape"}
    path = tmp_path / "plans.json"
    entries = [{"kind": "int8", "group_size": 192, "rows": 4, "n": 48, "k": 192, "plan": plan}]
    path.write_text(json.dumps({"plans": entries}))
    monkeypatch.setenv(int_plan.PLANS_ENV, str(path))
    assert int_plan.plan_matmul(3, 48, 192, 192, torch.device("cpu"), "int8") == MatmulPlan(**plan)


def test_baked_plans_pick_the_h200_sweep_winners_unless_the_environment_says_none(
    empty_plan_table, monkeypatch
) -> None:
    from kvfleet_engine.kernels import fp8_gemv

    monkeypatch.setattr(fp8_gemv, "GEMV_TABLE", {})
    monkeypatch.delenv(int_plan.PLANS_ENV, raising=False)
    assert int_plan.load_env_plans() > 0
    cpu = torch.device("cpu")
    # H200 sweep3 (bench/results/2026-12-01-...-quant-sweep-llama-3.1-8b-run3.json): at 1 row the
    # lean GEMV wins every int8 product; the half2 sweep of 2026-12-02
    # (...-quant-sweep-llama-3.1-8b-row1-half2.json): int4 gate_up in one-warp half2 programs of
    # 256 columns (a GPU's table entry: the interpreter, which runs no inline PTX, gets the
    # shape rules instead), o still in the lean GEMV
    gate_up = dict(int_plan.PLAN_TABLE[("int4", 128, 28672, 4096)])[1]
    assert (gate_up.kernel, gate_up.block_n, gate_up.block_k, gate_up.split_k) == (
        "half2", 256, 64, 18,
    )  # fmt: skip
    assert gate_up.num_warps == 1
    assert int_plan.plan_matmul(1, 28672, 4096, 128, cpu).kernel == "gemv"  # interpreted here
    assert int_plan.plan_matmul(1, 4096, 4096, 128, cpu).kernel == "lean"
    assert int_plan.plan_matmul(1, 28672, 4096, 4096, cpu, "int8").kernel == "lean"
    assert int_plan.plan_matmul(64, 4096, 14336, 128, cpu).kernel == "mma"
    assert int_plan.plan_matmul(300, 4096, 14336, 128, cpu).kernel == "dequantize"  # past 256
    fp8_qkv = fp8_gemv.table_gemv_plan(1, 6144, 4096)
    assert fp8_qkv is not None and (fp8_qkv.block_n, fp8_qkv.block_k) == (64, 256)
    int_plan.PLAN_TABLE.clear()
    int_plan.load_env_plans.cache_clear()
    monkeypatch.setenv(int_plan.PLANS_ENV, "none")
    assert int_plan.load_env_plans() == 0
    assert int_plan.plan_matmul(1, 28672, 4096, 128, cpu).block_k == 64  # the shape rules
    assert int_plan.PLAN_TABLE == {}


def test_plan_table_rejects_unknown_fields_and_kinds_naming_them(empty_plan_table) -> None:
    entry = {"kind": "int4", "group_size": 128, "rows": 1, "n": 8, "k": 128}
    with pytest.raises(ValueError, match=r"plan fields \['block_q'\] unknown"):
        int_plan.install_plans([entry | {"plan": {"kernel": "mma", "block_m": 16, "block_q": 1}}])
    with pytest.raises(ValueError, match="plan kernel 'tiles' unknown"):
        int_plan.install_plans(
            [entry | {"plan": {"kernel": "tiles", "block_m": 16, "block_n": 32, "block_k": 32}}]
        )
    with pytest.raises(ValueError, match=r"plan fields \['block_n', 'block_k'\] missing"):
        int_plan.install_plans([entry | {"plan": {"kernel": "mma", "block_m": 16}}])
    with pytest.raises(ValueError, match="plan kind 'int2' unknown"):
        int_plan.install_plans([entry | {"kind": "int2", "plan": {}}])


@on_cpu
def test_int4_matmul_runs_a_table_plan(empty_plan_table) -> None:
    plan = {"kernel": "mma", "block_m": 16, "block_n": 32, "block_k": 128, "swap_ab": True}
    weight = make_int4(72, 384, 128)
    int_plan.install_plans(
        [{"kind": "int4", "group_size": 128, "rows": 4, "n": 72, "k": 384, "plan": plan}]
    )
    x = make_x(3, 384, dtype=torch.float16)
    out = int4.int4_matmul(x, weight.qweight, weight.scales, weight.offsets, 128)
    assert relative_error(out, layout.int4_linear_reference(x.float(), weight)) < 2e-3


# ---- on the GPU, the Llama-3.1-8B products ------------------------------------------------------

GPU_MMA = [  # (plan, rows)
    pytest.param(MatmulPlan("mma", 16, 64, 128, 8), 1, id="planes-16-split8"),
    pytest.param(MatmulPlan("mma", 16, 128, 128, 4, swap_ab=True), 8, id="planes-swap"),
    pytest.param(MatmulPlan("mma", 16, 64, 64, 4, unpack="reshape", swap_ab=True), 16, id="swap"),
    pytest.param(
        MatmulPlan("mma", 64, 128, 64, unpack="reshape", num_warps=4, num_stages=4), 64, id="64"
    ),
    pytest.param(
        MatmulPlan("mma", 128, 128, 64, unpack="reshape", num_warps=8, num_stages=3),
        300,
        id="128",
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("codes", ["int4", "int8"])
@pytest.mark.parametrize(("plan", "m"), GPU_MMA)
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_gpu_mma_llama_products(n, k, plan, m, codes) -> None:
    """bfloat16 x: int4 codes as 128 + code, int8 as float16 1152 + code against x in float16."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    x = make_x(m, k, dtype=torch.bfloat16, device=DEVICE)
    if codes == "int4":
        weight = make_int4(n, k, 128)
        out, expected = run_int4(x, weight, plan), layout.int4_linear_reference(x, weight)
    else:
        weight8 = make_int8(n, k, None)
        out, expected = run_int8(x, weight8, plan), layout.int8_linear_reference(x, weight8)
    assert relative_error(out, expected) < 1e-2


FP8_VARIANTS = [  # (plan fields), rows
    pytest.param({"swap_ab": True}, 3, id="swap"),
    pytest.param({"half_dot": True, "split_k": 3}, 5, id="half-split3"),
    pytest.param(
        {"swap_ab": True, "half_dot": True, "split_k": 2, "reduce": "kernel"}, 16, id="both"
    ),
]


@on_cpu
@pytest.mark.parametrize(("fields", "m"), FP8_VARIANTS)
def test_fp8_gemv_variants_match_reference(fields, m) -> None:
    """The weight-only fp8 GEMV with the weight as the left operand and / or a float16 dot."""
    from test_quant_matmul import fp8_gemv, make_fp8

    weight = make_fp8(80, 256)
    x = make_x(m, 256, dtype=torch.float16)
    plan = fp8_gemv.Fp8GemvPlan(16, 32, 64, **fields)
    out = fp8_gemv.fp8_gemv(x, weight.weight, weight.scale, torch.float16, plan)
    assert relative_error(out, layout.fp8_weight_only_reference(x.float(), weight)) < 1e-3


def test_fp8_plan_table_picks_the_gemv_plan(monkeypatch) -> None:
    from test_quant_matmul import fp8_gemv

    monkeypatch.setattr(fp8_gemv, "GEMV_TABLE", {})
    plan = {"block_m": 16, "block_n": 32, "block_k": 64, "swap_ab": True, "half_dot": True}
    int_plan.install_plans([{"kind": "fp8", "rows": 8, "n": 80, "k": 256, "plan": plan}])
    assert fp8_gemv.table_gemv_plan(5, 80, 256) == fp8_gemv.Fp8GemvPlan(**plan)
    assert fp8_gemv.table_gemv_plan(9, 80, 256) is None
    with pytest.raises(ValueError, match=r"fp8 plan fields \['tile'\] unknown"):
        int_plan.install_plans([{"kind": "fp8", "rows": 8, "n": 80, "k": 256, "plan": {"tile": 1}}])


def test_fp8_w8a8_plan_table_picks_backend_and_blocks(monkeypatch) -> None:
    """A plan file's fp8-w8a8 entry decides how the products of up to its rows run: the Triton
    GEMM with its blocks (the result still the reference's), or _scaled_mm; past its rows, or
    where _scaled_mm cannot take the product (a float16 output), the shape-class rules."""
    from test_quant_matmul import fp8, make_fp8

    monkeypatch.setattr(fp8, "W8A8_TABLE", {})
    blocks = [32, 32, 64, 4, 1]
    int_plan.install_plans(
        [
            {"kind": "fp8-w8a8", "rows": 48, "n": 80, "k": 96,
             "plan": {"backend": "triton", "blocks": blocks}},
            {"kind": "fp8-w8a8", "rows": 64, "n": 80, "k": 96, "plan": {"backend": "scaled_mm"}},
        ]
    )  # fmt: skip
    assert fp8.w8a8_plan(40, 80, 96, torch.bfloat16) == fp8.W8A8Plan("triton", tuple(blocks))
    assert fp8.w8a8_plan(60, 80, 96, torch.bfloat16) == fp8.W8A8Plan("scaled_mm")
    assert fp8.w8a8_plan(60, 80, 96, torch.float16) == fp8.W8A8Plan("triton")  # rules
    assert fp8.w8a8_plan(65, 80, 96, torch.bfloat16) == fp8.W8A8Plan("triton")  # rules: batch
    used = []
    launch = fp8.triton_fp8_gemm
    monkeypatch.setattr(
        fp8, "triton_fp8_gemm", lambda *args: used.append(args[-1]) or launch(*args)
    )
    if not ON_GPU:
        weight = make_fp8(80, 96)
        x = make_x(40, 96, dtype=torch.float16)
        out = fp8.fp8_matmul(x, weight.weight, weight.scale, torch.float16)
        assert used == [tuple(blocks)]
        assert relative_error(out, layout.fp8_linear_reference(x, weight)) < 2e-3
    with pytest.raises(ValueError, match=r"backend 'cutlass' unknown"):
        int_plan.install_plans(
            [{"kind": "fp8-w8a8", "rows": 8, "n": 80, "k": 96, "plan": {"backend": "cutlass"}}]
        )
    with pytest.raises(ValueError, match=r"needs blocks"):
        int_plan.install_plans(
            [{"kind": "fp8-w8a8", "rows": 8, "n": 80, "k": 96, "plan": {"backend": "triton"}}]
        )
