"""What programmatic dependent launch saves per kernel boundary inside a CUDA graph (H200):
chains of 128 tiny one-program kernels, of 128 naive GEMVs and of both, replayed from a graph
with and without PDL (the GEMV also with its first weight tile loaded before the wait).

    python bench/pdl_probe.py    # on a GPU; JSON to $OUT/pdl_probe.json
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

LAYERS, PER_LAYER, DIM = 32, 4, 4096


@triton.jit
def norm_like(x_ptr, out_ptr, N: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + 1e-6)
    tl.store(out_ptr + offs, (x * rstd).to(tl.bfloat16))


@triton.jit
def gemv_like(
    x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GDC: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros((BN,), tl.float32)
    if PREFETCH:
        w0 = tl.load(w_ptr + tl.arange(0, BK)[:, None] * N + cols[None, :])
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:
        x0 = tl.load(x_ptr + tl.arange(0, BK)).to(tl.float32)
        acc += tl.sum(w0.to(tl.float32) * x0[:, None], 0)
    for k0 in range(BK if PREFETCH else 0, K, BK):
        rows = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rows[:, None] * N + cols[None, :])
        x = tl.load(x_ptr + rows).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[:, None], 0)
    tl.store(out_ptr + cols, acc.to(tl.bfloat16))


def run(pdl: bool, prefetch: bool, kind: str) -> tuple[float, int]:
    """(µs per graph replay, kernels per replay) of one chain."""
    x = torch.randn(DIM, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.empty(DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    # one weight per layer (32 MB each), so L2 does not hold them between layers
    weights = [torch.randn(DIM, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    options = {"launch_pdl": True} if pdl else {}

    def step() -> None:
        src = x
        for layer in range(LAYERS):
            for _ in range(PER_LAYER):
                if kind in ("norm", "mix"):
                    norm_like[(1,)](src, bufs[0], N=DIM, GDC=pdl, num_warps=4, **options)
                    src = bufs[0]
                if kind in ("gemv", "mix"):
                    gemv_like[(DIM // 64,)](
                        src, weights[layer], bufs[1], DIM, K=DIM, BN=64, BK=64, GDC=pdl,
                        PREFETCH=prefetch, num_warps=4, **options,
                    )  # fmt: skip
                    src = bufs[1]

    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        step()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            step()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 50
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    launches = LAYERS * PER_LAYER * (2 if kind == "mix" else 1)
    return start.elapsed_time(end) * 1000 / reps, launches


def main() -> None:
    rows = []
    for kind in ("norm", "gemv", "mix"):
        for pdl, prefetch in ((False, False), (True, False), (True, True)):
            if kind == "norm" and prefetch:
                continue
            us, launches = run(pdl, prefetch, kind)
            rows.append(dict(kind=kind, pdl=pdl, prefetch=prefetch, us=us, launches=launches,
                             per_launch_us=us / launches))  # fmt: skip
            print(f"{kind:5s} pdl={pdl!s:5s} prefetch={prefetch!s:5s} {us:9.1f} us "
                  f"{us / launches:6.2f} us/launch", flush=True)  # fmt: skip
    path = os.path.join(os.environ.get("OUT", "/tmp"), "pdl_probe.json")
    with open(path, "w") as file:
        json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
