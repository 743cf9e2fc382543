"""What fetching the next product's weights into L2 saves in a batch-1 decode step (H200).

32 layers of the Llama-3.1-8B shape with distinct random weights in one format, each layer the
step's chain of one-row kernels: add+RMSNorm, qkv, three small kernels standing in for rotary
and the two attention kernels, o, add+RMSNorm, gate_up, silu-and-mul, down — the engine's own
kernels and plans, with PDL. Each variant launches a prefetch kernel (one `prefetch.global.L2`
per 128-byte line of the next product's weights, up to a cap in MB, plain or evict_last) just
before or just after each product; the chain is captured in one CUDA graph and timed by
replaying it; µs per layer against no prefetch.

Outcome on the H200 (2026-12-03, `bench/results/2026-12-03-nvidia-h200-l2-prefetch-probe.json`):
every variant slower: a layer took 10-33% longer, more the more it prefetched (the prefetch
kernels seem to last until their lines arrive, serialising the fetch they were meant to
overlap). The engine does not prefetch.

    python bench/l2_prefetch_probe.py [FORMATS]   # on a GPU; default fp8,int4,int8; JSON to $OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from kvfleet_engine.bench.gemv import graph_seconds, layer_shapes
from kvfleet_engine.bench.quant_gemv import make_weights
from kvfleet_engine.kernels import activation, pdl, quant_matmul
from kvfleet_engine.kernels.pdl import _start, launch_options
from kvfleet_engine.kernels.rms_norm import rms_norm

LAYERS, GROUP = 32, 128
LINE, LINES_PER_PROGRAM = 128, 1024  # bytes per L2 line; 128 KiB per program of 4 warps
VARIANTS = [  # (name, mode, MB, evict_last)
    ("off", "", 0, False),
    ("before:16", "before", 16, False),
    ("before:24", "before", 24, False),
    ("before:32", "before", 32, False),
    ("before:48", "before", 48, False),
    ("before:24:last", "before", 24, True),
    ("after:16", "after", 16, False),
    ("after:24", "after", 24, False),
    ("after:32", "after", 32, False),
    ("after:24:last", "after", 24, True),
]


@triton.jit
def l2_prefetch_kernel(base_ptr, lines, LINES: tl.constexpr, EVICT_LAST: tl.constexpr,
                       PDL: tl.constexpr):  # fmt: skip
    """Each thread requests LINES // threads lines of [base, base + lines * 128) into L2."""
    _start(PDL)
    offs = tl.minimum(tl.program_id(0) * LINES + tl.arange(0, LINES), lines - 1)
    tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;"
        if EVICT_LAST
        else "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [base_ptr + offs.to(tl.int64) * 128],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch_l2(tensor: torch.Tensor, max_bytes: int, evict_last: bool) -> None:
    lines = min(tensor.numel() * tensor.element_size(), max_bytes) // LINE
    l2_prefetch_kernel[(triton.cdiv(lines, LINES_PER_PROGRAM),)](
        tensor.view(torch.uint8), lines, LINES=LINES_PER_PROGRAM, EVICT_LAST=evict_last,
        num_warps=4, **launch_options(tensor.device),
    )  # fmt: skip


def product(fmt: str, x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if fmt == "fp8":
        return quant_matmul.fp8_matmul(x, w[0], w[1], x.dtype)
    if fmt == "int8":
        return quant_matmul.int8_matmul(x, w[0], w[1], x.shape[1])
    return quant_matmul.int4_matmul(x, w[0], w[1], w[2], GROUP)


def layer_us(fmt: str, weights: list, mode: str, mb: int, last: bool) -> float:
    device = torch.device("cuda")
    hidden = layer_shapes("llama-3.1-8b")[1][1]
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    norm_w = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    flat = [w for layer in weights for w in layer]  # execution order of the products

    def run(index: int, inp: torch.Tensor) -> torch.Tensor:
        ahead = flat[(index + 1) % len(flat)][0]
        if mode == "before":
            prefetch_l2(ahead, mb << 20, last)
        out = product(fmt, inp, flat[index])
        if mode == "after":
            prefetch_l2(ahead, mb << 20, last)
        return out

    def step() -> None:
        h, residual = x, torch.zeros_like(x)
        for layer in range(LAYERS):
            base = 4 * layer
            h, residual = rms_norm(h, norm_w, 1e-5, residual)
            qkv = run(base, h)
            a = qkv[:, :hidden]
            for _ in range(3):  # rotary, attention split and merge
                a, _ = rms_norm(a, norm_w, 1e-5)
            h = run(base + 1, a)
            h, residual = rms_norm(h, norm_w, 1e-5, residual)
            h = run(base + 3, activation.silu_and_mul(run(base + 2, h)))

    return graph_seconds(step, 21) / LAYERS * 1e6


def main() -> int:
    formats = (sys.argv[1] if len(sys.argv) > 1 else "fp8,int4,int8").split(",")
    pdl.set_default(True)
    device = torch.device("cuda")
    shapes = layer_shapes("llama-3.1-8b")
    results: dict[str, dict[str, float]] = {}
    for fmt in formats:
        weights = [[make_weights(fmt, n, k, device) for _, n, k in shapes] for _ in range(LAYERS)]
        results[fmt] = {}
        for name, mode, mb, last in VARIANTS:
            results[fmt][name] = layer_us(fmt, weights, mode, mb, last)
            base = results[fmt]["off"]
            got = results[fmt][name]
            print(f"{fmt:5} {name:16} {got:7.1f} us/layer  {base / got:5.3f}x", flush=True)
        del weights
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "l2_prefetch_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "us_per_layer": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
