"""The quantized-product candidates `quant_sweep` times: per kind and row count, the kernel
variants × configs (each a JSON-able record: family, plan fields, programs per SM), their names,
and how one runs on a product (its concrete plan, split-K from programs per SM, then the
kernel). `bench.kernel_asm` compiles the same space for sm_90 on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton

from kvfleet_engine.bench.quant_gemv import INT4_GROUP, Weights
from kvfleet_engine.kernels import fp8_gemv, int_plan
from kvfleet_engine.kernels import fp8_matmul as fp8
from kvfleet_engine.kernels import int4_matmul as ints
from kvfleet_engine.kernels.checks import next_power_of_2

KINDS = ("bf16", "int4", "int8", "fp8")
LABELS = {"bf16": "bf16", "int4": f"int4-g{INT4_GROUP}", "int8": "int8", "fp8": "fp8"}
Config = dict[str, Any]  # {"family", "plan": fields, "per_sm"}: one candidate, JSON-able


def _int(kernel: str, bm: int, bn: int, bk: int, per_sm: int = 0, **fields: Any) -> Config:
    return {"family": "int", "per_sm": per_sm, "plan": dict(kernel=kernel, block_m=bm,
            block_n=bn, block_k=bk, **fields)}  # fmt: skip


def _fp8(bn: int, bk: int, per_sm: int = 4, **fields: Any) -> Config:
    plan = dict(block_m=16, block_n=bn, block_k=bk, **fields)
    return {"family": "fp8-gemv", "per_sm": per_sm, "plan": plan}


def int_configs(kind: str, m: int) -> list[Config]:
    """int4 (group 128) / int8 (per channel) candidates at m rows: the shipped kernels' best
    configs so far as baselines, and the tensor-core "mma" kernel's variants."""
    out: list[Config] = []
    four = kind == "int4"
    if m == 1:  # the 2-D CUDA-core GEMV: (BLOCK_N, BLOCK_K, warps, per SM, stages)
        rows = [(256, 128, 4, 8, 3), (128, 64, 4, 8, 1), (128, 64, 4, 8, 3), (64, 128, 2, 8, 3)]
        if not four:
            rows = [(256, 16, 4, 8, 3), (128, 64, 4, 4, 1), (128, 64, 4, 4, 3), (128, 32, 4, 8, 3)]
        out += [_int("gemv", 1, bn, bk, s, num_warps=w, num_stages=st) for bn, bk, w, s, st in rows]
        # the lean GEMV (int_gemv_lean: one LOP3 / PRMT and one FFMA per code): wider column
        # blocks amortize each thread's x loads over more codes
        lean = [(128, 64, 4, 8, 1), (256, 64, 4, 8, 1), (256, 128, 4, 8, 3), (512, 32, 4, 8, 1),
                (256, 32, 2, 8, 1), (128, 128, 2, 8, 3), (512, 64, 8, 8, 3), (256, 64, 4, 16, 3),
                (128, 64, 4, 4, 3)]  # fmt: skip
        if not four:
            lean = [(256, 16, 4, 8, 3), (512, 16, 4, 8, 1), (256, 32, 4, 8, 3), (128, 64, 4, 4, 1),
                    (512, 32, 8, 8, 3), (256, 16, 2, 16, 3), (1024, 16, 8, 8, 1),
                    (512, 16, 4, 4, 3)]  # fmt: skip
        out += [_int("lean", 1, bn, bk, s, num_warps=w, num_stages=st) for bn, bk, w, s, st in lean]
        # Nsight Compute (2026-12-02): the lean GEMV at 127 registers runs 4 programs of 4 warps
        # an SM with no warp eligible half the time; capped registers (some spilled) fit more
        # programs, and one-warp programs over wide column blocks issue fewer x loads per code
        capped = [(256, 64, 4, 8, 1, 96), (256, 64, 4, 8, 1, 80), (128, 64, 4, 8, 1, 64),
                  (512, 32, 1, 8, 1, None), (512, 32, 1, 16, 1, None), (1024, 16, 2, 8, 1, None),
                  (512, 32, 1, 16, 1, 168)]  # fmt: skip
        if not four:
            capped = [(256, 16, 4, 8, 3, 96), (256, 16, 4, 8, 3, 80), (128, 64, 4, 4, 1, 64),
                      (512, 16, 1, 8, 1, None), (512, 16, 1, 16, 1, None)]  # fmt: skip
        out += [_int("lean", 1, bn, bk, s, num_warps=w, num_stages=st, max_registers=r)
                for bn, bk, w, s, st, r in capped]  # fmt: skip
        if four:  # int_gemv_half2: two codes per instruction as float16 pairs (~2 per code)
            half2 = [(512, 32, 1, 8, 1), (512, 32, 1, 16, 1), (256, 64, 2, 8, 1),
                     (256, 64, 4, 8, 3), (128, 128, 2, 8, 3), (1024, 32, 2, 8, 1),
                     (512, 64, 2, 8, 1), (256, 32, 1, 16, 1), (128, 64, 1, 16, 1)]  # fmt: skip
            # the first sweep's winners (gate_up 256/32/1 warp, down 128/128/2 warps) left the
            # GEMV latency-bound: more loads in flight per SM (programs, rows, stages)
            half2 += [(256, 64, 1, 16, 1), (256, 64, 1, 24, 2), (256, 32, 1, 24, 1),
                      (256, 32, 1, 32, 1), (128, 64, 1, 32, 1), (512, 64, 1, 16, 2),
                      (256, 128, 2, 16, 2), (128, 128, 1, 16, 3), (256, 32, 1, 16, 3),
                      (128, 128, 2, 16, 3), (64, 128, 1, 16, 3), (64, 64, 1, 32, 2),
                      (128, 32, 1, 16, 1), (32, 128, 1, 16, 3)]  # fmt: skip
            out += [_int("half2", 1, bn, bk, s, num_warps=w, num_stages=st)
                    for bn, bk, w, s, st in half2]  # fmt: skip
    elif m <= int_plan.ROW_GEMV_MAX_ROWS:
        rows = [(128, 64, 4, 8, 3), (64, 64, 2, 8, 3)] if four else [(128, 16, 4, 4, 3)]
        out += [_int("gemv", m, bn, bk, s, num_warps=w, num_stages=st) for bn, bk, w, s, st in rows]
    if m <= 16:
        if m > 1:  # the split-K dot the table picks now
            out.append(_int("dot", 16, 128, 128 if four else 64, 4, int4_planes=four))
        unpacks = ["planes", "reshape"] if four else ["reshape"]
        for unpack in unpacks:
            for bn in (64, 128):
                for swap in (False, True):
                    for per_sm in (4, 8):
                        out.append(_int("mma", 16, bn, 128, per_sm, unpack=unpack, swap_ab=swap))
        out.append(_int("mma", 16, 32, 128, 8, unpack=unpacks[0], swap_ab=True))
        # swapped operands (compile since round 2): more programs, wider tiles, more stages
        for unpack in unpacks:
            out.append(_int("mma", 16, 64, 128, 16, unpack=unpack, swap_ab=True))
            out.append(_int("mma", 16, 128, 128, 8, unpack=unpack, swap_ab=True, num_stages=4))
            out.append(_int("mma", 16, 256, 128, 4, unpack=unpack, swap_ab=True, num_warps=8))
            out.append(_int("mma", 16, 64, 128, 8, unpack=unpack, swap_ab=True, num_warps=2))
        out.append(_int("mma", 16, 64, 64, 8, unpack="reshape", swap_ab=True))
        out.append(_int("mma", 16, 128, 128, 4, unpack=unpacks[0], swap_ab=True, num_warps=8))
        if not four:
            out.append(_int("mma", 16, 64, 128, 4, swap_ab=True, int8_cast=True))
            out.append(_int("mma", 16, 64, 128, 4, int8_cast=True))
        return out
    out.append(_int("dequantize", 0, 128, 64))  # dequantize + cuBLAS, what the table picks now
    # prompt tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, per SM)
    tiles = [(64, 128, 64, 4, 4, 0), (64, 128, 128, 4, 3, 0), (64, 256, 64, 8, 3, 0)]
    tiles += [(64, 128, 64, 4, 4, 2), (32, 128, 128, 4, 4, 2)]
    if m > 64:
        tiles += [(128, 128, 64, 8, 3, 0), (128, 128, 64, 4, 4, 0), (128, 256, 64, 8, 3, 0)]
        tiles += [(128, 128, 128, 8, 3, 0), (128, 128, 64, 8, 4, 1)]
    for bm, bn, bk, w, st, per_sm in tiles:
        out.append(_int("mma", bm, bn, bk, per_sm, unpack="reshape", num_warps=w, num_stages=st))
    out.append(_int("mma", 64, 128, 128, 0, unpack="planes" if four else "reshape"))
    out.append(_int("mma", 64, 128, 64, 2, unpack="reshape", swap_ab=True))
    if not four:
        out.append(_int("mma", 64, 128, 64, 0, num_warps=4, num_stages=4, int8_cast=True))
        out.append(_int("mma", 128, 128, 64, 0, num_warps=8, num_stages=3, int8_cast=True))
    # swapped operands: the dequantized weight tile is the dot's left operand, which Hopper's
    # wgmma reads from registers (the right one, x^T, from shared memory). (BLOCK_M rows of x =
    # the MMA's N, BLOCK_N, BLOCK_K, warps, stages); kernel_asm: none of these spills (BLOCK_N
    # 256 with BLOCK_M 128, BLOCK_M 256, or BLOCK_M 128 on 4 warps spill 144-584 bytes), int4
    # BLOCK_K 128 stores its reshaped tile to shared memory (66-132 STS per step, against 5-11)
    swapped = [(64, 128, 64, 4, 3), (64, 256, 64, 8, 3), (64, 64, 128, 4, 4)]
    if m > 64:
        swapped += [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3)]
    for bm, bn, bk, w, st in swapped:
        out.append(_int("mma", bm, bn, bk, 0, unpack="reshape", swap_ab=True, num_warps=w,
                        num_stages=st))  # fmt: skip
    return out


# The Triton W8A8 GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the first three up
# to fp8_matmul.BATCH_MAX_ROWS rows, all of them above (a decode step of 256-768 rows, where
# _scaled_mm ran 1.24x bf16 on the H200 on 2026-12-01, not the 1.9x of a prompt step).
W8A8_BLOCKS = (
    (64, 128, 128, 4, 4), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (64, 256, 128, 8, 3),
    (64, 128, 128, 4, 3), (128, 128, 128, 4, 3), (128, 64, 128, 4, 4), (64, 64, 128, 4, 4),
    (128, 128, 64, 8, 5), (128, 256, 64, 8, 4), (64, 128, 256, 4, 3),
)  # fmt: skip


def fp8_configs(m: int) -> list[Config]:
    """fp8: the weight-only GEMV (tensor cores, x not quantized) up to 16 rows, with its dot in
    x's dtype or float16 and either operand order; W8A8 (_scaled_mm, Triton) above."""
    if m > fp8_gemv.GEMV_MAX_ROWS:
        out: list[Config] = [{"family": "fp8-scaled_mm", "per_sm": 0, "plan": {}}]
        for blocks in W8A8_BLOCKS if m > fp8.BATCH_MAX_ROWS else W8A8_BLOCKS[:3]:
            out.append({"family": "fp8-w8a8-triton", "per_sm": 0, "plan": {"blocks": blocks}})
        return out
    out = []
    for bn, bk in ((64, 128), (32, 128), (64, 256), (128, 128)):
        for swap in (False, True):
            for half in (False, True):
                out.append(_fp8(bn, bk, 4, swap_ab=swap, half_dot=half))
    out += [_fp8(64, 128, 8, swap_ab=True, half_dot=True), _fp8(32, 256, 8, half_dot=True)]
    out += [_fp8(64, 128, 4, swap_ab=True, half_dot=True, num_warps=8)]
    if m == fp8.DECODE_MAX_ROWS:
        out.append(
            {"family": "fp8-w8a8-triton", "per_sm": 0, "plan": {"blocks": (16, 32, 256, 4, 4)}}
        )
    return out


def configs(kind: str, m: int) -> list[Config]:
    if kind == "bf16":
        return [{"family": "bf16", "per_sm": 0, "plan": {}}]
    return fp8_configs(m) if kind == "fp8" else int_configs(kind, m)


def config_name(config: Config) -> str:
    plan, family = config["plan"], config["family"]
    if family in ("bf16", "fp8-scaled_mm"):
        return family
    if family == "fp8-w8a8-triton":
        return f"{family} {plan['blocks']}"
    keys = {"block_m": "m", "block_n": "n", "block_k": "k", "num_warps": "w", "num_stages": "s"}
    keys["max_registers"] = "r"  # a register cap, when the candidate sets one
    parts = [plan.get("kernel", "gemv")]
    parts += [f"{short}{plan[key]}" for key, short in keys.items() if plan.get(key) is not None]
    parts += [key for key in ("swap_ab", "half_dot", "int8_cast") if plan.get(key)]
    if plan.get("kernel") == "mma" and "unpack" in plan:
        parts.append(plan["unpack"])
    if plan.get("kernel") == "dot" and not plan.get("int4_planes", True):
        parts.append("reshape")
    if config["per_sm"]:
        parts.append(f"{config['per_sm']}/sm")
    return " ".join(parts)


def resolve(config: Config, m: int, n: int, k: int, group: int) -> Any:
    """The concrete plan of a config for one product (split-K from programs per SM)."""
    family, fields, per_sm = config["family"], dict(config["plan"]), config["per_sm"]
    cuda = torch.device("cuda")
    if family == "int":
        if fields["kernel"] in ("gemv", "lean", "half2"):
            fields["block_m"] = next_power_of_2(m)
            fields["block_k"] = min(fields["block_k"], group & -group)
        tiles = triton.cdiv(n, fields["block_n"])
        if fields["kernel"] != "gemv":
            tiles *= triton.cdiv(m, max(1, fields["block_m"]))
        if per_sm:
            fields["split_k"] = int_plan.split_for(tiles, k // fields["block_k"], cuda, per_sm)
        return int_plan.plan_from_dict(fields)
    if family == "fp8-gemv":
        steps = triton.cdiv(k, fields["block_k"])
        fields["split_k"] = int_plan.split_for(
            triton.cdiv(n, fields["block_n"]), steps, cuda, per_sm
        )
        return fp8_gemv.Fp8GemvPlan(**fields)
    return fields


def product(config: Config) -> Callable[[torch.Tensor, Weights], torch.Tensor]:
    family = config["family"]

    def run(x: torch.Tensor, w: Weights) -> torch.Tensor:
        if family == "bf16":
            return F.linear(x, w[0])
        if family == "int":
            qweight, scales = w[0], w[1]
            k, n = x.shape[1], qweight.shape[1]
            group = k // scales.shape[0]
            plan = resolve(config, x.shape[0], n, k, group)
            return ints.launch(x, qweight, scales, w[2] if len(w) == 3 else None, group, plan)
        n, k = w[0].shape
        if family == "fp8-gemv":
            plan = resolve(config, x.shape[0], n, k, k)
            return fp8_gemv.fp8_gemv(x, w[0], w[1], torch.bfloat16, plan)
        x_q, x_scale = fp8.quantize_fp8_rows(x)
        if family == "fp8-scaled_mm":
            return fp8.scaled_mm_fp8(x_q, x_scale, w[0], w[1])
        blocks = tuple(config["plan"]["blocks"])
        return fp8.triton_fp8_gemm(x_q, x_scale, w[0], w[1], torch.bfloat16, blocks)

    return run
