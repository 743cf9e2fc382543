"""Do Inductor's autotuned GEMM templates, the persistent TMA one among them, beat cuBLAS on a
decode step's bf16 products? (NOTES section 23, after section 21.)

A c256 decode step (Llama-3.1-8B shape, 256 rows) spends 6.29 of its 13.0 ms on the H200 in
four bf16 products per layer at ≈ 610 TFLOP/s (62% of the dense peak); section 21's plain
Triton GEMM lost to cuBLAS by 15-30% at 256 rows, and pointed at Hopper's TMA and persistent,
warp-specialized kernels. PyTorch's Inductor carries such templates (`mm_persistent_tma`);
this probe lets max-autotune choose among them, its other Triton configs and cuBLAS for each
product and row count, then times the chosen kernel against cuBLAS the way bf16_gemm_probe
does (8 weights in rotation, each case replayed from a CUDA graph). Inductor prints its
AUTOTUNE table (the best choices and their times) to stderr as it goes.

    PYTHONPATH=engine python bench/bf16_autotune_probe.py [--rows 128 256 512] [--output p.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch._inductor.config as inductor
import torch.nn.functional as F
from bf16_gemm_probe import SHAPES, WEIGHTS, graph_us


def configure(search_space: str) -> None:
    inductor.max_autotune = True
    inductor.max_autotune_gemm = True
    inductor.max_autotune_gemm_backends = "ATEN,TRITON"
    inductor.max_autotune_gemm_search_space = search_space
    inductor.triton.enable_persistent_tma_matmul = True
    inductor.triton.cudagraphs = False  # the probe captures its own graphs
    inductor.autotune_num_choices_displayed = 6


def write(args: argparse.Namespace, results: list, totals: dict) -> None:
    record = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "command": "PYTHONPATH=engine python bench/bf16_autotune_probe.py "
        + "--rows " + " ".join(map(str, args.rows)) + f" --search-space {args.search_space}",
        "results": results, "layer_us": totals,
    }  # fmt: skip
    with open(args.output, "w") as handle:
        json.dump(record, handle, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--search-space", choices=("DEFAULT", "EXHAUSTIVE"), default="DEFAULT")
    parser.add_argument("--output", default="bf16_autotune_probe.json")
    args = parser.parse_args()
    configure(args.search_space)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = []
    totals: dict[int, dict[str, float]] = {m: {"cublas": 0.0, "inductor": 0.0} for m in args.rows}
    for name, (n, k) in SHAPES.items():
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(WEIGHTS)
        ]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.reset()
            linear = torch.compile(F.linear, dynamic=False, fullgraph=True)
            reference = F.linear(x, weights[0]).float()
            got = linear(x, weights[0]).float()  # autotunes this shape
            error = ((got - reference).norm() / reference.norm()).item()
            cublas = graph_us(lambda i, x=x, ws=weights: F.linear(x, ws[i]))
            tuned = graph_us(lambda i, x=x, ws=weights, f=linear: f(x, ws[i]))
            flops = 2 * m * n * k
            row = {
                "product": name, "rows": m, "cublas_us": cublas, "inductor_us": tuned,
                "inductor_over_cublas": cublas / tuned, "relative_error": error,
                "cublas_tflops": flops / cublas / 1e6, "inductor_tflops": flops / tuned / 1e6,
            }  # fmt: skip
            results.append(row)
            totals[m]["cublas"] += cublas
            totals[m]["inductor"] += min(cublas, tuned)
            write(args, results, totals)  # each case as it lands: a capped call keeps them
            print(
                f"{name:<8} {m:>4} rows: cuBLAS {cublas:7.1f} us ({row['cublas_tflops']:4.0f} "
                f"TFLOP/s), autotuned {tuned:7.1f} us ({row['inductor_tflops']:4.0f}), "
                f"{cublas / tuned:.2f}x, error {error:.1e}",
                flush=True,
            )
    for m, total in totals.items():
        print(
            f"layer {m:>4} rows: cuBLAS {total['cublas']:7.1f} us, best of both "
            f"{total['inductor']:7.1f} us ({total['cublas'] / total['inductor']:.2f}x)"
        )
    write(args, results, totals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
