"""Planning of the integer-weight products (`int4_matmul`, `int8_matmul`): the shape table
that picks a kernel (GEMV, dot or dequantize + cuBLAS) and its block sizes per product class, as a
`MatmulPlan`, and `split_for`, the slices of K that fill the SMs (also used by `fp8_gemv`).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import triton

from kvfleet_engine.kernels.checks import next_power_of_2, num_sms

# The shape tables below follow the sweeps on the H200 (bench.quant_sweep; Llama-3.1-8B products).
GEMV_MAX_ROWS = 1  # up to this many rows the GEMV (2 rows and more: the split-K dot was faster)
ROW_GEMV_MAX_ROWS = 4  # the 2-D GEMV takes up to this many rows of x (int4; int8 one)
DOT_MAX_SPLIT_ROWS = 16  # up to this many rows the dot kernel splits K (decode batches)
DEQUANTIZE_MIN_ROWS = 17  # from this many rows, dequantize once and use cuBLAS (the dot tiles
# read the weight once but measured 2x to 5x slower at 64 and 256 rows)
WIDE_N = 16384  # outputs from which a product counts as wide (gate_up) in the tables
LONG_K = 8192  # inputs from which a product counts as long (down)
KERNELS = ("gemv", "lean", "half2", "dot", "mma", "dequantize")  # lean, half2: one row
SPLIT_REDUCE = ("last", "kernel")  # who sums split-K partials: the last program, or a kernel
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # no inline PTX (half2, PRMT) then


@dataclass(frozen=True)
class MatmulPlan:
    kernel: str  # one of KERNELS
    block_m: int  # rows of x per program (gemv: all of them, a power of two)
    block_n: int  # output columns per program
    block_k: int  # rows of the weight per loop step; a power of two dividing group_size
    split_k: int = 1  # gemv / dot: slices of K, summed as split_reduce says
    split_reduce: str = "last"  # one of SPLIT_REDUCE
    int4_planes: bool = True  # dot: int4 as 8 nibble planes (else unpacked by a reshape)
    scale_after_dot: bool = True  # dot: scales on the group's product (else on the weights)
    biased_codes: bool = False  # dot, int4 planes, scales after the dot, 16-bit x: codes + bias
    unpack: str = "planes"  # mma, int4: one of int_mma.UNPACKS
    swap_ab: bool = False  # mma: out^T = W^T x^T (the weight is the dot's left operand)
    int8_cast: bool = False  # mma, int8: codes cast to x's dtype (else float16 from their bits)
    num_warps: int = 4
    num_stages: int = 3
    max_registers: int | None = None  # ptxas's cap per thread (None: its choice); more programs

    def launch_options(self) -> dict[str, Any]:
        """The Triton launch options of the plan's kernel."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages,
                "maxnreg": self.max_registers}  # fmt: skip


def split_for(n_blocks: int, k_steps: int, device: torch.device, per_sm: int = 4) -> int:
    """Slices of K that give about `per_sm` programs per SM (at least 2 steps per slice)."""
    wanted = max(1, per_sm * num_sms(device) // max(1, n_blocks))
    return max(1, min(wanted, k_steps // 2))


def row_gemv_blocks(codes: str, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K before the group's cap, warps, programs per SM) of the one-row GEMV,
    the fastest measured per product class."""
    if codes == "int8":
        return (256, 16, 4, 8) if n >= WIDE_N else (128, 64, 4, 4)
    if n >= WIDE_N:
        return 128, 64, 4, 8
    if k >= LONG_K:
        return 64, 128, 2, 8
    return 256, 128, 4, 8


# (codes, group_size, N, K) -> [(rows, plan)] sorted by rows: the plan for M rows of x is the
# first whose rows >= M (the default rules below past the last). Filled by `install_plans`:
# first from BAKED_PLANS (bench.quant_sweep's winners on the H200, the Llama-3.1-8B products),
# then from the JSON file $KVFLEET_QUANT_PLANS names (its entries replace baked ones; "none"
# installs no baked plans either, so the shape rules below decide).
PLAN_TABLE: dict[tuple[str, int, int, int], list[tuple[int, MatmulPlan]]] = {}
PLANS_ENV = "KVFLEET_QUANT_PLANS"
BAKED_PLANS = os.path.join(os.path.dirname(__file__), "quant_plans.json")
PLAN_FIELDS = tuple(field.name for field in fields(MatmulPlan))


def put_rows(table: dict[Any, list[tuple[int, Any]]], key: Any, rows: int, value: Any) -> None:
    """Set `table[key]`'s entry for `rows` (replacing one for the same rows), kept sorted by
    rows: the shape of every plan table here ((shape) -> [(rows, plan)])."""
    listed = [(r, v) for r, v in table.get(key, []) if r != rows]
    table[key] = sorted([*listed, (rows, value)], key=lambda entry: entry[0])


def rows_at_least(table: dict[Any, list[tuple[int, Any]]], key: Any, m: int) -> Any:
    """The value of `table[key]`'s first entry whose rows >= m (None past the last, or none)."""
    for rows, value in table.get(key, []):
        if rows >= m:
            return value
    return None


def plan_from_dict(plan: dict[str, Any]) -> MatmulPlan:
    """A MatmulPlan from its fields by name (ValueError naming an unknown field or kernel)."""
    unknown = sorted(set(plan) - set(PLAN_FIELDS))
    if unknown:
        raise ValueError(f"plan fields {unknown} unknown; allowed: {list(PLAN_FIELDS)}")
    missing = [name for name in ("kernel", "block_m", "block_n", "block_k") if name not in plan]
    if missing:
        raise ValueError(f"plan fields {missing} missing")
    made = MatmulPlan(**plan)
    if made.kernel not in KERNELS:
        raise ValueError(f"plan kernel {made.kernel!r} unknown; allowed: {list(KERNELS)}")
    if made.split_reduce not in SPLIT_REDUCE:
        raise ValueError(f"split_reduce {made.split_reduce!r}: allowed {list(SPLIT_REDUCE)}")
    return made


def install_plans(entries: list[dict[str, Any]]) -> None:
    """Add plan-table entries {"kind", "rows", "n", "k", "plan": {...}}: "int4" | "int8" (also
    "group_size") here; "fp8" to fp8_gemv's table, "fp8-w8a8" (the products above 16 rows) to
    fp8_matmul's, "bf16-tma" (16-bit products for the TMA GEMM) to tma_gemm's."""
    from kvfleet_engine.kernels import fp8_gemv, fp8_matmul, tma_gemm  # import this module

    others = {
        "fp8": fp8_gemv.install_gemv_plan,
        "fp8-w8a8": fp8_matmul.install_w8a8_plan,
        "bf16-tma": tma_gemm.install_tma_plan,
    }
    for entry in entries:
        kind, rows, n, k = entry["kind"], int(entry["rows"]), int(entry["n"]), int(entry["k"])
        if kind in others:
            others[kind](rows, n, k, entry["plan"])
            continue
        if kind not in ("int4", "int8"):
            allowed = ["int4", "int8", *others]
            raise ValueError(f"plan kind {kind!r} unknown; allowed: {allowed}")
        key = (kind, int(entry["group_size"]), n, k)
        put_rows(PLAN_TABLE, key, rows, plan_from_dict(entry["plan"]))


def _plan_file(path: str) -> list[dict[str, Any]]:
    with open(path) as file:
        entries = json.load(file)
    return entries["plans"] if isinstance(entries, dict) else entries


@functools.cache
def load_env_plans() -> int:
    """Install the baked plans, then those of the JSON file $KVFLEET_QUANT_PLANS names (once;
    "none": neither); how many."""
    path = os.environ.get(PLANS_ENV, "")
    if path == "none":
        return 0
    entries = _plan_file(BAKED_PLANS) + (_plan_file(path) if path else [])
    install_plans(entries)
    return len(entries)


def table_plan(codes: str, m: int, n: int, k: int, group_size: int) -> MatmulPlan | None:
    """The table's plan for M rows; a half2 plan (inline PTX) not under the interpreter."""
    load_env_plans()
    plan = rows_at_least(PLAN_TABLE, (codes, group_size, n, k), m)
    if plan is None or (plan.kernel == "half2" and INTERPRETED):
        return None  # the shape rules decide
    return replace(plan, block_m=next_power_of_2(m)) if plan.kernel == "gemv" else plan


def plan_matmul(
    m: int, n: int, k: int, group_size: int, device: torch.device, codes: str = "int4"
) -> MatmulPlan:
    """The plan table's entry for the product, else block sizes by shape class and codes
    ("int4" or "int8"): fixed tables, so nothing is tuned inside graph capture."""
    listed = table_plan(codes, m, n, k, group_size)
    if listed is not None:
        return listed
    pow2_of_group = group_size & -group_size  # the largest power of two dividing group_size
    if m <= GEMV_MAX_ROWS:
        block_n, block_k, warps, per_sm = row_gemv_blocks(codes, n, k)
        block_k = min(block_k, pow2_of_group)
        split = split_for(triton.cdiv(n, block_n), k // block_k, device, per_sm)
        return MatmulPlan(
            "gemv", next_power_of_2(m), block_n, block_k, split, num_warps=warps, num_stages=1
        )
    if m >= DEQUANTIZE_MIN_ROWS or pow2_of_group < 16:  # tl.dot needs K tiles of >= 16
        return MatmulPlan("dequantize", 0, 128, min(64, pow2_of_group))
    block_k = min(128 if codes == "int4" else 64, pow2_of_group)
    planes = block_k >= 128  # 8 planes of >= 16 packed rows each
    block_n = 256 if codes == "int4" and n >= WIDE_N else 128
    split = split_for(triton.cdiv(n, block_n), k // block_k, device)
    return MatmulPlan("dot", 16, block_n, block_k, split, int4_planes=planes)
