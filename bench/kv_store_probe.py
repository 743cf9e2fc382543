"""Time the decode step's fused rotary + store (`kernels.fused.rotary_store_kv`) alone over an
fp8 cache, rounded to nearest and calibrated (`kv_cache_calibration`'s moves, `kernels.kv_shaping`),
Llama-3.1-8B's heads (32 query, 8 kv, 128 dims), on a GPU (a probe).

    PYTHONPATH=engine python bench/kv_store_probe.py [--rank 8] [--steps 16] [--warps 4]
        [--tokens 1 256]

`--steps` and `--warps` replace the kernel's move count and warps for this process (variants to
compare before changing the engine); run the tree to compare with `PYTHONPATH=OTHER/engine`.
Prints one JSON line: microseconds per launch, mean of 200 after 5 warm-up launches."""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import triton.language as tl
from gpu_probe import time_us

from kvfleet_engine.kernels import fused
from kvfleet_engine.layers import kv_shaping

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS = 32, 8, 128, 16, 4096


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=kv_shaping.SHAPE_RANK)
    parser.add_argument("--steps", type=int, default=kv_shaping.SHAPE_STEPS)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256])
    args = parser.parse_args(argv)
    fused._SHAPE_STEPS = tl.constexpr(args.steps)
    fused.launch_options = lambda device: {"PDL": False, "num_warps": args.warps}
    device = "cuda"
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(KV_HEADS, DIM, DIM, generator=generator)
    moment = kv_shaping.factor(spread @ spread.mT, args.rank).to(device)
    cos_sin = torch.randn(8192, DIM, device=device)
    k_cache = torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM, dtype=torch.float8_e4m3fn, device=device)
    v_cache = torch.zeros(BLOCKS, KV_HEADS, DIM, BLOCK, dtype=k_cache.dtype, device=device)
    v_cache = v_cache.permute(0, 3, 1, 2)  # token major (`checks.token_major`)
    k_scales = torch.zeros(BLOCKS, KV_HEADS, BLOCK, dtype=torch.bfloat16, device=device)
    v_scales = torch.zeros_like(k_scales)
    row = {"rank": args.rank, "steps": args.steps, "warps": args.warps}
    for tokens in args.tokens:
        q = torch.randn(tokens, HEADS, DIM, device=device, dtype=torch.bfloat16)
        k = torch.randn(tokens, KV_HEADS, DIM, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        positions = torch.randint(0, 8000, (tokens,), device=device)
        slots = torch.randperm(BLOCKS * BLOCK, device=device)[:tokens]
        inputs = (positions, q, k, v, cos_sin, k_cache, v_cache, slots)
        for name, shaped in (("nearest", None), ("calibrated", moment)):
            launch = functools.partial(
                fused.rotary_store_kv, *inputs, k_scales=k_scales, v_scales=v_scales,
                hadamard=True, k_moment=shaped,
            )  # fmt: skip
            row[f"{name}_us_{tokens}"] = round(time_us(launch, rounds=200, warmup=5), 2)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
