"""The quantized products of one decoder layer (qkv, o, gate_up, down) against bf16 F.linear: for
each batch size (rows of x) and format, the time per layer, bytes read, achieved GB/s and its
fraction of the measured copy bandwidth, and TFLOP/s; then sweeps of the candidates still open
(decode rows: CUDA-core GEMV blocks, split-K and pipelined weight loads, the split-K
tensor-core kernel, the fp8 weight-only GEMV; prompt rows: the best dot tiles against
dequantize + cuBLAS) with each product's fastest candidate (what the shape tables in
kernels/int_plan.py and fp8_gemv.py / fp8_matmul.py should pick).

Each product runs for every layer (distinct weights per layer, so nothing stays in L2) in one
CUDA graph, timed by replaying it.

    python -m kvfleet_engine.bench.quant_gemv --shape llama-3.1-8b --tokens 1,4,16,256,4096

--variants picks the formats; besides the engine's kernels it can time torch's own weight-only
ops on the same products (int4-g128-tinygemm: `_weight_int4pack_mm`, gpt-fast's int4 kernel,
checked against its dequantized weights first; int8-torch: `_weight_int8pack_mm`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

from kvfleet_engine.bench.gemv import copy_bandwidth, graph_seconds, layer_shapes
from kvfleet_engine.bench.results import Row, gpu_name, write_results
from kvfleet_engine.bench.shapes import SHAPES
from kvfleet_engine.kernels import fp8_gemv, int_plan
from kvfleet_engine.kernels import fp8_matmul as fp8
from kvfleet_engine.kernels import int4_matmul as ints
from kvfleet_engine.kernels.checks import next_power_of_2
from kvfleet_engine.quant.layout import FP8_DTYPE

INT4_GROUP = 128
Weights = tuple[torch.Tensor, ...]  # one product's weight tensors in its format
Product = Callable[[torch.Tensor, Weights], torch.Tensor]  # (x [M, K], weights) -> [M, N]


def make_weights(fmt: str, n: int, k: int, device: torch.device) -> Weights:
    """Random weights of one [N, K] product in a kernel layout (values do not change timing)."""
    if fmt == "bf16":
        return (torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02,)
    if fmt == "int8":  # per output channel, as quantize_int8 makes by default
        qweight = torch.randint(-127, 128, (k, n), device=device, dtype=torch.int8)
        return qweight, torch.rand(1, n, device=device) * 1e-3
    if fmt == "int4":
        qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), device=device, dtype=torch.int32)
        scales = torch.rand(k // INT4_GROUP, n, device=device, dtype=torch.float16) * 1e-2
        return qweight, scales, -8 * scales
    if fmt == "int4-tinygemm":  # torch's own int4 kernel (gpt-fast's): its packed layout
        codes = torch.randint(0, 16, (n, k), device=device, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack(tinygemm_bytes(codes), 8)
        scales = torch.rand(k // INT4_GROUP, n, 1, device=device, dtype=torch.bfloat16) * 1e-2
        return packed, torch.cat([scales, torch.zeros_like(scales)], dim=2).contiguous()
    if fmt == "int8-torch":  # torch's int8 weight-only op: [N, K] codes, a scale per channel
        codes = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
        return codes, torch.rand(n, device=device, dtype=torch.bfloat16) * 1e-3
    weight = (torch.randn(n, k, device=device) * 0.02).to(FP8_DTYPE)
    return weight, torch.rand(n, device=device) * 1e-3


def tinygemm_bytes(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (0..15) as the uint8 [N, K // 2] that torch's
    _convert_weight_to_int4pack takes: column 2 i in the high nibble, 2 i + 1 in the low."""
    return ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)


def check_tinygemm(device: torch.device) -> str:
    """torch._weight_int4pack_mm against the dequantized weights it should compute with
    (w = (code - 8) * scale + zero per group of 128 along K): the largest relative error."""
    n, k, m = 512, 1024, 4
    codes = torch.randint(0, 16, (n, k), device=device, dtype=torch.int32)
    scales = torch.rand(k // INT4_GROUP, n, device=device, dtype=torch.bfloat16) * 1e-2 + 1e-3
    zeros = torch.randn(k // INT4_GROUP, n, device=device, dtype=torch.bfloat16) * 1e-2
    packed = torch.ops.aten._convert_weight_to_int4pack(tinygemm_bytes(codes), 8)
    pairs = torch.stack([scales, zeros], dim=2).contiguous()
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm(x, packed, INT4_GROUP, pairs).float()
    groups = torch.arange(k, device=device) // INT4_GROUP
    weight = (codes.float() - 8) * scales.float()[groups].t() + zeros.float()[groups].t()
    ref = x.float() @ weight.t()
    error = ((out - ref).abs().max() / ref.abs().max()).item()
    return f"tinygemm check [{m}x{k}] @ [{k}x{n}]: max error {error:.2e} of the largest output"


PlanOf = Callable[[int, int, int, int, str], int_plan.MatmulPlan]  # (m, n, k, group, codes) -> plan


def int_product(plan_of: PlanOf) -> Product:
    """An int4 or int8 product run with the plan `plan_of(m, n, k, group_size, codes)`."""

    def product(x: torch.Tensor, w: Weights) -> torch.Tensor:
        qweight, scales = w[0], w[1]
        offsets = w[2] if len(w) == 3 else None
        k, n = x.shape[1], qweight.shape[1]
        group = k // scales.shape[0]
        codes = "int8" if qweight.dtype == torch.int8 else "int4"
        plan_ = plan_of(x.shape[0], n, k, group, codes)
        return ints.launch(x, qweight, scales, offsets, group, plan_)

    return product


def auto_plan(m: int, n: int, k: int, group: int, codes: str) -> int_plan.MatmulPlan:
    return int_plan.plan_matmul(m, n, k, group, torch.device("cuda"), codes)


def fp8_product(backend: str, blocks: tuple | None = None) -> Product:
    """backend: "auto" (fp8_matmul's choice), "gemv" (weight-only), "scaled_mm" or "triton"."""

    def product(x: torch.Tensor, w: Weights) -> torch.Tensor:
        if backend == "auto":
            return fp8.fp8_matmul(x, w[0], w[1], torch.bfloat16)
        if backend == "gemv":
            return fp8_gemv.fp8_gemv(x, w[0], w[1], torch.bfloat16, blocks)
        x_q, x_scale = fp8.quantize_fp8_rows(x)
        if backend == "scaled_mm":
            return fp8.scaled_mm_fp8(x_q, x_scale, w[0], w[1])
        return fp8.triton_fp8_gemm(x_q, x_scale, w[0], w[1], torch.bfloat16, blocks)

    return product


VARIANTS: dict[str, tuple[str, Product]] = {  # name -> (format, product)
    "bf16": ("bf16", lambda x, w: F.linear(x, w[0])),
    "int8": ("int8", int_product(auto_plan)),
    f"int4-g{INT4_GROUP}": ("int4", int_product(auto_plan)),
    "fp8": ("fp8", fp8_product("auto")),
    "fp8-w8a8-scaled_mm": ("fp8", fp8_product("scaled_mm")),
    "fp8-w8a8-triton": ("fp8", fp8_product("triton")),
    "int4-g128-tinygemm": (
        "int4-tinygemm",
        lambda x, w: torch.ops.aten._weight_int4pack_mm(x, w[0], INT4_GROUP, w[1]),
    ),
    "int8-torch": ("int8-torch", lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1])),
}


def plan(kernel: str, block_m: int, block_n: int, block_k: int, per_sm: int = 0, **kw) -> PlanOf:
    """A fixed plan whose split-K gives about `per_sm` programs per SM (0: no split)."""

    def plan_of(m: int, n: int, k: int, group: int, codes: str) -> int_plan.MatmulPlan:
        bk = min(block_k, group & -group)
        bm = block_m or next_power_of_2(m)
        tiles = triton.cdiv(n, block_n) * (1 if kernel == "gemv" else triton.cdiv(m, bm))
        split = int_plan.split_for(tiles, k // bk, torch.device("cuda"), per_sm) if per_sm else 1
        return int_plan.MatmulPlan(kernel, bm, block_n, bk, split, **kw)

    return plan_of


def gemv_candidates(fmt: str, m: int) -> dict[str, PlanOf]:
    """Decode rows. One row: the 2-D GEMV's best blocks so far (BLOCK_N, BLOCK_K, warps, programs
    per SM), weight loads pipelined (s3: cp.async 2 steps ahead) or not (s1). 4 rows: int4's
    2-D GEMV with a tile per row of x, int8's 3-D GEMV, and the split-K tensor-core kernel;
    16 rows: that kernel's tiles (int4 nibble planes at K steps of 128, their codes converted
    or biased, made from their bits; or reshaped codes)."""
    if m == 1:
        blocks = [(256, 128, 4, 8), (128, 64, 4, 8), (64, 128, 2, 8)]
        if fmt == "int8":  # a [BLOCK_K, BLOCK_N] register tile per row: int8 steps are shorter
            blocks = [(256, 16, 4, 8), (128, 64, 4, 4), (128, 32, 4, 8)]
        return {
            f"gemv bn{bn} bk{bk} w{w} {s}/sm s{st}": plan(
                "gemv", 0, bn, bk, s, num_warps=w, num_stages=st
            )
            for bn, bk, w, s in blocks
            for st in (1, 3)
        }  # fmt: skip
    out: dict[str, PlanOf] = {}
    if m <= int_plan.ROW_GEMV_MAX_ROWS:
        gemv = [(128, 64, 4, 8, 1), (128, 64, 4, 8, 3), (64, 64, 2, 8, 3)]
        if fmt == "int8":  # the 3-D GEMV
            gemv = [(128, 16, 4, 4, 3)]
        for bn, bk, w, s, st in gemv:
            out[f"gemv bn{bn} bk{bk} w{w} {s}/sm s{st}"] = plan(
                "gemv", 0, bn, bk, s, num_warps=w, num_stages=st
            )
    # (BLOCK_N, BLOCK_K, per SM, planes, codes + bias made from their bits)
    dots = [(128, 128, 4, True, False), (256, 128, 4, True, False), (128, 128, 4, True, True)]
    if m > int_plan.ROW_GEMV_MAX_ROWS:
        dots += [(128, 128, 4, False, False), (256, 128, 4, True, True)]
    if fmt == "int8":  # int8 codes load as they are (no planes)
        dots = [(128, 64, 4, False, False), (128, 128, 4, False, False)]
    for bn, bk, s, planes, biased in dots:
        name = f"dot bn{bn} bk{bk}{' planes' if planes and fmt == 'int4' else ''}"
        name += f"{' biased' if biased else ''} {s}/sm"
        out[name] = plan("dot", 16, bn, bk, s, int4_planes=planes, biased_codes=biased)
    return out


def prompt_candidates(m: int) -> dict[str, PlanOf]:
    """The best dot tile so far (scales on the weights for int4, after the dot for int8) against
    dequantize + cuBLAS, which won every prompt size measured."""
    out: dict[str, PlanOf] = {
        "dot 128x128x64 w8 s4 scaled-w": plan(
            "dot", 128, 128, 64, int4_planes=False, scale_after_dot=False, num_warps=8,
            num_stages=4,
        ),
        "dot 64x128x128 w4 s3 scale-after": plan(
            "dot", 64, 128, 128, int4_planes=True, scale_after_dot=True, num_warps=4,
            num_stages=3,
        ),
    }  # fmt: skip
    out["dequantize+cuBLAS"] = lambda m, n, k, g, codes: int_plan.MatmulPlan(
        "dequantize", 0, 128, 64
    )
    return out


def fp8_candidates(m: int) -> dict[str, Product]:
    """The weight-only GEMV's dot form (BLOCK_N, BLOCK_K, warps, programs per SM; its FMA form
    measured 112 us per 8B layer at one row), and at 16 rows the best W8A8 Triton tile."""
    out: dict[str, Product] = {}
    dots = [(64, 128, 4, 4), (32, 128, 4, 4)]
    dots += [(64, 256, 4, 4)] if m != 4 else []
    for bn, bk, w, s in dots:
        out[f"gemv-dot bn{bn} bk{bk} w{w} {s}/sm"] = fp8_gemv_product(m, bn, bk, w, s, True)
    if m == fp8.DECODE_MAX_ROWS:
        blocks = (16, 32, 256, 4, 4)
        out[f"w8a8-triton {blocks}"] = fp8_product("triton", blocks)
    return out


def fp8_gemv_product(m: int, bn: int, bk: int, warps: int, per_sm: int, dot: bool) -> Product:
    def product(x: torch.Tensor, w: Weights) -> torch.Tensor:
        n, k = w[0].shape
        split = int_plan.split_for(triton.cdiv(n, bn), triton.cdiv(k, bk), x.device, per_sm)
        blocks = (next_power_of_2(m), bn, bk, warps, split, dot, "last")
        return fp8_gemv.fp8_gemv(x, w[0], w[1], torch.bfloat16, blocks)

    return product


class Bench:
    def __init__(self, shape: str, layers: int, bandwidth: float) -> None:
        self.device = torch.device("cuda")
        self.shapes = layer_shapes(shape)  # (name, N, K)
        self.layers = layers
        self.bandwidth = bandwidth
        self.weights: dict[str, list[list[Weights]]] = {}  # format -> [layer][product]
        self.x: dict[tuple[int, int], torch.Tensor] = {}

    def weights_of(self, fmt: str) -> list[list[Weights]]:
        if fmt not in self.weights:
            self.weights[fmt] = [
                [make_weights(fmt, n, k, self.device) for _, n, k in self.shapes]
                for _ in range(self.layers)
            ]
        return self.weights[fmt]

    def run(self, m: int, fmt: str, product: Product, variant: str) -> dict[str, Any]:
        """Each of the layer's products timed over all layers; totals per layer."""
        weights = self.weights_of(fmt)
        per_product: dict[str, dict[str, float]] = {}
        for index, (name, n, k) in enumerate(self.shapes):
            if (m, k) not in self.x:
                self.x[m, k] = torch.randn(m, k, device=self.device, dtype=torch.bfloat16)
            x = self.x[m, k]

            def step(index: int = index, x: torch.Tensor = x) -> None:
                for layer in weights:
                    product(x, layer[index])

            seconds = graph_seconds(step) / self.layers
            weight_bytes = sum(t.numel() * t.element_size() for t in weights[0][index])
            product_bytes = weight_bytes + 2 * m * (k + n)  # weights, bf16 x in and out
            per_product[name] = {
                "us": seconds * 1e6,
                "bytes": product_bytes,
                "gb_per_s": product_bytes / seconds / 1e9,
                "of_copy": product_bytes / seconds / self.bandwidth,
                "tflop_per_s": 2 * m * n * k / seconds / 1e12,
            }
        seconds = sum((p["us"] for p in per_product.values()), 0.0) / 1e6
        moved = sum((p["bytes"] for p in per_product.values()), 0.0)
        flops = sum(2 * m * n * k for _, n, k in self.shapes)
        return {
            "tokens": m,
            "variant": variant,
            "layer_us": seconds * 1e6,
            "bytes": moved,
            "gb_per_s": moved / seconds / 1e9,
            "of_copy": moved / seconds / self.bandwidth,
            "tflop_per_s": flops / seconds / 1e12,
            "products": per_product,
        }


def describe(run: dict[str, Any]) -> str:
    parts = " ".join(
        f"{name} {p['us']:7.1f}us {p['of_copy']:4.0%}" for name, p in run["products"].items()
    )
    return (
        f"{run['tokens']:5} {run['variant']:34} {run['layer_us']:8.1f} us/layer "
        f"{run['gb_per_s']:6.0f} GB/s {run['of_copy']:5.0%} of copy "
        f"{run['tflop_per_s']:6.1f} TFLOP/s | {parts}"
    )


def plans_line(m: int, shapes: list[tuple[str, int, int]]) -> str:
    """The plans the int4 and int8 wrappers pick for each product at m rows."""
    out = []
    for fmt, group_of in (("int4", lambda k: INT4_GROUP), ("int8", lambda k: k)):
        for name, n, k in shapes:
            p = auto_plan(m, n, k, group_of(k), fmt)
            out.append(
                f"{fmt} {name}: {p.kernel} bm{p.block_m} bn{p.block_n} bk{p.block_k} "
                f"split{p.split_k}{'' if p.int4_planes else ' reshape'}"
                f"{' scale-after' if p.scale_after_dot else ''} w{p.num_warps} s{p.num_stages}"
            )
    return "plans  " + "; ".join(out)


def safe_run(bench: Bench, m: int, fmt: str, product: Product, variant: str) -> dict | None:
    try:
        run = bench.run(m, fmt, product, variant)
    except Exception as error:  # a candidate that does not compile is a result, not the end
        print(f"{m:5} {variant:34} failed: {type(error).__name__}: {str(error)[:300]}")
        return None
    print(describe(run), flush=True)
    return run


def best_per_product(runs: list[dict[str, Any]]) -> dict[str, str]:
    best: dict[str, tuple[float, str]] = {}
    for run in runs:
        for name, p in run["products"].items():
            if name not in best or p["us"] < best[name][0]:
                best[name] = (p["us"], run["variant"])
    return {name: f"{variant} ({us:.1f} us)" for name, (us, variant) in best.items()}


def sweep_groups(m: int) -> list[tuple[str, str, dict[str, Product]]]:
    """(format, label, candidates) swept at m rows."""
    groups = []
    for fmt, label in (("int4", f"int4-g{INT4_GROUP}"), ("int8", "int8")):
        plans = (
            gemv_candidates(fmt, m) if m <= int_plan.DOT_MAX_SPLIT_ROWS else prompt_candidates(m)
        )
        groups.append((fmt, label, {name: int_product(plan) for name, plan in plans.items()}))
    if m <= fp8.DECODE_MAX_ROWS:
        groups.append(("fp8", "fp8", fp8_candidates(m)))
    return groups


def result_rows(runs: list[dict[str, Any]], bandwidth: float) -> list[Row]:
    rows = [Row("roofline", "copy_bandwidth", bandwidth / 1e9, "GB/s")]
    for run in runs:
        metric = f"layer_products_us_t{run['tokens']}_{run['variant']}"
        rows.append(Row("kvfleet", metric, run["layer_us"], "us"))
        rows.append(Row("kvfleet", metric.replace("_us_", "_of_copy_"), run["of_copy"], "fraction"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.quant_gemv")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--tokens", default="1,4,8,16,64,256,4096", help="comma-separated rows of x"
    )
    parser.add_argument(
        "--sweep-tokens", default="1,4,16,256", help="rows to sweep plans at ('' none)"
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}"
    )
    parser.add_argument("--output-dir", type=Path)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; of {list(VARIANTS)}")
    if not torch.cuda.is_available():
        print("quant_gemv: needs a CUDA GPU", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    bench = Bench(args.shape, args.layers, bandwidth)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.layers} layers; per layer:")
    if "int4-g128-tinygemm" in variants:
        try:
            print(check_tinygemm(bench.device))
        except Exception as error:  # an op this torch build lacks is a result too
            print(f"tinygemm check failed: {type(error).__name__}: {str(error)[:300]}")
    runs = []
    for m in (int(t) for t in args.tokens.split(",")):
        print(plans_line(m, bench.shapes))
        for variant in variants:
            fmt, product = VARIANTS[variant]
            run = safe_run(bench, m, fmt, product, variant)
            runs += [run] if run else []
    sweep_best: dict[str, dict[str, str]] = {}
    sweep_runs: list[dict[str, Any]] = []

    def save() -> None:  # after each part, so a run cut short keeps what it measured
        if not args.output_dir:
            return
        workload = {"layers": args.layers, "tokens": args.tokens, "runs": runs}
        workload |= {"sweep_best": sweep_best, "sweep_runs": sweep_runs}
        path = write_results(
            args.output_dir,
            f"quant-gemv-{args.shape}",
            gpu_name(bench.device),
            "python -m kvfleet_engine.bench.quant_gemv " + shlex.join(argv or sys.argv[1:]),
            args.shape,
            workload,
            result_rows(runs, bandwidth),
        )
        print(f"wrote {path}")

    save()
    for m in (int(t) for t in args.sweep_tokens.split(",") if t):
        for fmt, label, candidates in sweep_groups(m):
            print(f"--- sweep {label} at {m} rows")
            found = [safe_run(bench, m, fmt, p, f"{label} {n}") for n, p in candidates.items()]
            sweep_runs.extend(run for run in found if run)
            best = best_per_product([run for run in found if run])
            sweep_best[f"{label} m{m}"] = best
            print(f"best {label} m{m}: " + "; ".join(f"{k}: {v}" for k, v in best.items()))
            save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
