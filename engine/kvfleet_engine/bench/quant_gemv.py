"""The quantized products of one decoder layer (qkv, o, gate_up, down) against bf16 F.linear: for
each batch size (rows of x) and format, the time per layer, bytes read, achieved GB/s and its
fraction of the measured copy bandwidth, and TFLOP/s, with the plans the engine picks. The
candidates the plan tables choose from are `bench.quant_sweep`'s (checked, then timed).

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

from kvfleet_engine.bench.gemv import copy_bandwidth, graph_seconds, layer_shapes
from kvfleet_engine.bench.results import Row, gpu_name, write_results
from kvfleet_engine.bench.shapes import SHAPES
from kvfleet_engine.kernels import fp8_matmul as fp8
from kvfleet_engine.kernels import int_plan, quant_matmul
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


def int_product(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """An int4 (codes, scales, offsets) or int8 (codes, scales) product through the engine's own
    wrappers, so with the plan the table or the shape rules pick."""
    group = x.shape[1] // w[1].shape[0]
    if len(w) == 3:
        return quant_matmul.int4_matmul(x, w[0], w[1], w[2], group)
    return quant_matmul.int8_matmul(x, w[0], w[1], group)


def auto_plan(m: int, n: int, k: int, group: int, codes: str) -> int_plan.MatmulPlan:
    return int_plan.plan_matmul(m, n, k, group, torch.device("cuda"), codes)


def fp8_product(backend: str) -> Product:
    """backend: "auto" (fp8_matmul's choice), or W8A8 by "scaled_mm" or "triton"."""

    def product(x: torch.Tensor, w: Weights) -> torch.Tensor:
        if backend == "auto":
            return fp8.fp8_matmul(x, w[0], w[1], torch.bfloat16)
        x_q, x_scale = fp8.quantize_fp8_rows(x)
        if backend == "scaled_mm":
            return fp8.scaled_mm_fp8(x_q, x_scale, w[0], w[1])
        return fp8.triton_fp8_gemm(x_q, x_scale, w[0], w[1], torch.bfloat16)

    return product


VARIANTS: dict[str, tuple[str, Product]] = {  # name -> (format, product)
    "bf16": ("bf16", lambda x, w: F.linear(x, w[0])),
    "int8": ("int8", int_product),
    f"int4-g{INT4_GROUP}": ("int4", int_product),
    "fp8": ("fp8", fp8_product("auto")),
    "fp8-w8a8-scaled_mm": ("fp8", fp8_product("scaled_mm")),
    "fp8-w8a8-triton": ("fp8", fp8_product("triton")),
    "int4-g128-tinygemm": (
        "int4-tinygemm",
        lambda x, w: torch.ops.aten._weight_int4pack_mm(x, w[0], INT4_GROUP, w[1]),
    ),
    "int8-torch": ("int8-torch", lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1])),
}


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
    if args.output_dir:
        workload = {"layers": args.layers, "tokens": args.tokens, "runs": runs}
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
