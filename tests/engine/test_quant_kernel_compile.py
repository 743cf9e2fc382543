"""Every quantized-product kernel config the plan tables pick compiles for
the H200 (sm_90) with Triton's real compiler and the bundled ptxas, on the CPU: the interpreter
accepted the swapped-operand mma configs that failed to compile on the GPU (sweep1)."""

from __future__ import annotations

import json
import os

import pytest

from kvfleet_engine.bench import kernel_asm

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="compiles natively (interpreter off)"
)
SWAPPED_INT4 = [  # sweep1: CompilationError on the H200 for every one of these forms
    {
        "kernel": "mma",
        "block_m": 16,
        "block_n": 64,
        "block_k": 128,
        "swap_ab": True,
        "unpack": unpack,
        "split_k": 2,
    }
    for unpack in ("planes", "reshape")
]


@pytest.mark.slow
@pytest.mark.parametrize("plan", SWAPPED_INT4, ids=lambda p: p["unpack"])
def test_swapped_int4_mma_compiles_for_sm90_with_wide_loads_and_no_spills(plan) -> None:
    compiled = kernel_asm.compile_plan("int4", 1, 4096, 4096, plan)
    assert [c.name for c in compiled] == ["_mma_kernel"]
    found = kernel_asm.stats(compiled[0].kernel)
    assert found["spill_bytes"] == 0
    assert found["sass_ops"].get("LDGSTS", 0) + sum(found["sass_ldg"].values()) > 0
    assert 16 in found["ptx_global_loads_by_bytes"] or found["sass_ops"].get("LDGSTS", 0) > 0


# The plan tables' configs (what the engine runs); the sweep's whole space (~150 compiles, ~15 min
# on 2 cores) is checked by `python -m kvfleet_engine.bench.kernel_asm sweep 1,2,4,8,16,64,256`.
JOBS = kernel_asm.compile_jobs([], sweep=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, m, n, k, plan", JOBS, ids=[f"{j[0]}-m{j[1]}-{json.dumps(j[4])}" for j in JOBS]
)
def test_every_plan_table_config_compiles_for_sm90(kind, m, n, k, plan) -> None:
    compiled = kernel_asm.compile_plan(kind, m, n, k, plan)
    assert compiled and all(c.kernel.asm["cubin"] for c in compiled)


LEAN = {  # codes -> a lean GEMV plan (kernels.int_gemv_lean)
    "int4": {"kernel": "lean", "block_m": 1, "block_n": 256, "block_k": 64, "split_k": 2},
    "int8": {"kernel": "lean", "block_m": 1, "block_n": 512, "block_k": 16, "split_k": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("codes", ["int4", "int8"])
def test_lean_gemv_spends_one_int_op_and_one_ffma_per_code_in_its_k_loop(codes) -> None:
    """The K loop's SASS: per code one LOP3 (int4) or PRMT (int8, inline PTX) and one FFMA, no
    FADD per code (the int_gemv kernels take the magic number off each code with one)."""
    plan = LEAN[codes]
    compiled = kernel_asm.compile_plan(codes, 1, 28672, 4096, plan)
    found = kernel_asm.stats(compiled[0].kernel)
    codes_per_thread = plan["block_n"] * plan["block_k"] // (32 * 4)  # 4 warps
    loop = found["loop"]
    assert found["spill_bytes"] == 0
    assert codes_per_thread <= loop["FFMA"] < 1.6 * codes_per_thread
    assert loop.get("FADD", 0) < 0.4 * codes_per_thread  # per row and group, not per code
    converts = loop["LOP3"] if codes == "int4" else loop["PRMT"]
    assert codes_per_thread <= converts < 1.2 * codes_per_thread


@pytest.mark.parametrize("blocks", [(64, 128, 64, 4, 4), (128, 256, 64, 8, 3)])
def test_the_tma_gemm_compiles_for_sm90_to_tma_copies_and_wgmma_without_spills(blocks) -> None:
    import torch

    from kvfleet_engine.kernels import tma_gemm

    x, weight = (
        torch.zeros(256, 4096, dtype=torch.bfloat16),
        torch.zeros(4096, 4096, dtype=torch.bfloat16),
    )
    with kernel_asm.sm90_compiles() as compiled:
        tma_gemm.tma_gemm(x, weight, blocks, num_programs=132)
    [kernel] = [c.kernel for c in compiled]
    assert kernel_asm.stats(kernel)["spill_bytes"] == 0
    code = kernel_asm.sass(kernel)
    assert "UTMALDG.2D" in code and "HGMMA" in code and "UTMASTG.2D" in code
