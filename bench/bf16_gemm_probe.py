"""Do the decode steps' bf16 products leave time on the table at 64-512 rows? (NOTES section 21.)

A c256 decode step (Llama-3.1-8B shape) spends half its time in four bf16 products per layer
that cuBLAS runs at 455-560 TFLOP/s on an H100 (bench/overlap_probe.py): at 256 rows they are
neither bound by the weights' bytes nor by the tensor cores. This probe times each product at
64-512 rows through cuBLAS (F.linear), through a Triton GEMM over a small sweep of tiles and
split-K (the partial sums reduced by a second kernel, counted), and through the persistent TMA
GEMM (`kvfleet_engine.kernels.tma_gemm`, section 23) over its tiles and stages; 8 weights in
rotation so the L2 cache holds none of them, each case in a CUDA graph.

    PYTHONPATH=engine python bench/bf16_gemm_probe.py [--rows 64 128 256] [--output probe.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvfleet_engine.kernels.tma_gemm import tma_gemm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
WEIGHTS = 8  # in rotation: 8 x >= 33 MB is past any L2


@triton.jit
def _gemm(
    x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """out[pid_k] = x[:, ks] @ w[:, ks]^T for pid_k's slice ks of K (SPLIT > 1: float32
    partials [SPLIT, M, N]; else bf16 [M, N])."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        ks = k_start + k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < M, other=0.0)
        b = tl.load(w_ptr + cols[:, None] * K + ks[None, :])
        acc = tl.dot(a, tl.trans(b), acc)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + offsets, acc.to(tl.bfloat16), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + offsets, acc, mask=mask)


def triton_linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    block_m, block_n, block_k, split, warps, stages = config
    m, k = x.shape
    n = w.shape[0]
    k_per_split = k // split
    grid = (triton.cdiv(m, block_m), n // block_n, split)
    if split == 1:
        out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    else:
        out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _gemm[grid](
        x, w, out, m, n, k, k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT=split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out if split == 1 else out.sum(0).to(torch.bfloat16)


def graph_us(fn: Callable[[int], object], reps: int = 15) -> float:
    """Median µs of one call of fn(i), i cycling over the weights, replayed from a graph."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(4 * WEIGHTS):
            fn(i % WEIGHTS)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (4 * WEIGHTS))
    return sorted(times)[len(times) // 2]


def configs(m: int) -> list[tuple[int, ...]]:
    block_ms = [64] if m <= 64 else [64, 128]
    return [
        (bm, bn, 64, split, warps, stages)
        for bm, bn, split, warps, stages in itertools.product(
            block_ms, (64, 128, 256), (1, 2, 4), (4, 8), (3, 4)
        )
        if not (bn == 256 and warps == 4)
    ]


def tma_configs() -> list[tuple[int, ...]]:
    """The TMA GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) that fit 227 KB of shared
    memory (operand stages plus the output tile)."""
    out = []
    for bm, bn, bk, warps, stages in itertools.product(
        (64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4, 5)
    ):
        shared = (bm + bn) * bk * 2 * stages + bm * bn * 2
        if shared <= 227 * 1024 and not (bm == 128 and bn == 256 and warps == 4):
            out.append((bm, bn, bk, warps, stages))
    return out


QUICK_TMA = [
    (64, 128, 64, 4, 4), (64, 128, 64, 4, 5), (64, 256, 64, 8, 4), (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (64, 64, 128, 4, 4),
]  # fmt: skip


def best_of(
    fn: Callable[[torch.Tensor, torch.Tensor, tuple[int, ...]], torch.Tensor],
    candidates: list[tuple[int, ...]],
    x: torch.Tensor,
    weights: list[torch.Tensor],
    reference: torch.Tensor,
    label: str,
) -> tuple[float, tuple[int, ...] | None]:
    """The fastest correct config of `fn` (µs, config)."""
    best: tuple[float, tuple[int, ...] | None] = (float("inf"), None)
    for config in candidates:
        try:
            got = fn(x, weights[0], config)
        except (triton.runtime.errors.OutOfResources, triton.CompilationError):
            continue
        error = ((got.float() - reference.float()).norm() / reference.float().norm()).item()
        if error > 1e-2:
            print(f"{label} {config}: relative error {error:.3g}, skipped")
            continue
        us = graph_us(lambda i, c=config: fn(x, weights[i], c))
        if us < best[0]:
            best = (us, config)
    return best


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--output", default="bf16_gemm_probe.json")
    parser.add_argument(
        "--kernels", default="tiled,tma", help="which Triton GEMMs to sweep beside cuBLAS"
    )
    parser.add_argument("--quick", action="store_true", help="8 TMA shapes, not all 45")
    parser.add_argument(
        "--write-plans",
        help="write $KVFLEET_QUANT_PLANS entries (kind bf16-tma) here: the TMA GEMM's best "
        "blocks for each (product, rows) where it beat cuBLAS by 2%%, null (cuBLAS) where not",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    total = {"cublas": {}, "best": {}}
    for name, (n, k) in SHAPES.items():
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(WEIGHTS)
        ]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reference = F.linear(x, weights[0])
            cublas = graph_us(lambda i, x=x, ws=weights: F.linear(x, ws[i]))
            label = f"{name} m={m}"
            kernels = args.kernels.split(",")
            tiled_configs = configs(m) if "tiled" in kernels else []
            best = best_of(triton_linear, tiled_configs, x, weights, reference, label)
            tma_candidates = (
                (QUICK_TMA if args.quick else tma_configs()) if "tma" in kernels else []
            )
            tma = best_of(tma_gemm, tma_candidates, x, weights, reference, label + " tma")
            flops = 2 * m * n * k
            row = {
                "product": name, "rows": m, "cublas_us": cublas, "triton_us": best[0],
                "triton_config": best[1], "cublas_tflops": flops / cublas / 1e6,
                "triton_tflops": flops / best[0] / 1e6, "tma_us": tma[0], "tma_config": tma[1],
                "tma_tflops": flops / tma[0] / 1e6,
                "weight_bytes_us_at_3350": n * k * 2 / 3.35e6,
            }  # fmt: skip
            results.append(row)
            total["cublas"][m] = total["cublas"].get(m, 0.0) + cublas
            total["best"][m] = total["best"].get(m, 0.0) + min(cublas, best[0], tma[0])
            total.setdefault("tma", {})[m] = total.get("tma", {}).get(m, 0.0) + tma[0]
            print(
                f"{name:<8} m={m:<4} cuBLAS {cublas:7.1f} us ({row['cublas_tflops']:4.0f} TF/s)  "
                f"Triton {best[0]:7.1f} us ({row['triton_tflops']:4.0f}) {best[1]}  "
                f"TMA {tma[0]:7.1f} us ({row['tma_tflops']:4.0f}) {tma[1]}",
                flush=True,
            )
    for m in args.rows:
        print(f"layer at {m} rows: cuBLAS {total['cublas'][m]:.1f} us, TMA "
              f"{total['tma'][m]:.1f} us, best of all {total['best'][m]:.1f} us")  # fmt: skip
    record = {
        "gpu": torch.cuda.get_device_name(),
        "command": "PYTHONPATH=engine python bench/bf16_gemm_probe.py --rows "
        + " ".join(map(str, args.rows))
        + f" --kernels {args.kernels}"
        + (" --quick" if args.quick else ""),
        "results": results,
        "layer_us": total,
    }
    with open(args.output, "w") as handle:
        json.dump(record, handle, indent=1)
    if args.write_plans:
        plans = [
            {
                "kind": "bf16-tma",
                "rows": row["rows"],
                "n": SHAPES[row["product"]][0],
                "k": SHAPES[row["product"]][1],
                "plan": {
                    "blocks": row["tma_config"] if row["tma_us"] < 0.98 * row["cublas_us"] else None
                },
            }
            for row in results
        ]
        with open(args.write_plans, "w") as handle:
            json.dump({"plans": plans, "from": record["command"], "gpu": record["gpu"]}, handle)
        chosen = sum(p["plan"]["blocks"] is not None for p in plans)
        print(f"wrote {args.write_plans}: TMA for {chosen} of {len(plans)} (product, rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
