"""Where a prompt step's fp8 (W8A8) layer spends its time outside the products: one
Llama-3.1-8B decoder layer's four products at prompt size (16,384 rows, a step of the issue's
64 x 3,968 workload), bf16 against fp8, with the activation quantization apart, on a GPU (a
probe).

    PYTHONPATH=engine python bench/fp8_prompt_probe.py [--rows 16384] [--output FILE]

Rows of the table, microseconds per call (median of CUDA-event timings):
- bf16 product (torch.mm) and the fp8 product alone (`_scaled_mm` of e4m3 rows);
- quantize: `fp8_rows.quantize_fp8_rows` of the product's input, one pass (the row in
  registers) and two passes (the kernel before 2026-12-05);
- norm: the residual add + RMSNorm that makes qkv's and gate_up's input, bf16 out, and the same
  kernel with e4m3 rows out (what a layer pays when the norm quantizes);
- silu: silu * up alone (bf16 out), and fused with the quantization (`silu_and_mul_fp8`).
Prints a table and one JSON line (also written to --output)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from kvfleet_engine.kernels import activation, fp8_matmul, fp8_rows, rms_norm
from kvfleet_engine.quant.layout import quantize_fp8

HIDDEN, INNER = 4096, 14336
PRODUCTS = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INNER, HIDDEN),
            "down": (HIDDEN, INNER)}  # fmt: skip


def timed(fn: Callable[[], object], rounds: int = 20) -> float:
    """Median microseconds of fn() over `rounds` CUDA-event timings after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def two_pass(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    saved = fp8_rows.ROW_MAX_COLS
    fp8_rows.ROW_MAX_COLS = 0
    try:
        return fp8_rows.quantize_fp8_rows(x)
    finally:
        fp8_rows.ROW_MAX_COLS = saved


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--output", default="")
    args = parser.parse_args(argv)
    device, rows = torch.device("cuda"), args.rows
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    times: dict[str, float] = {}
    for name, (n, k) in PRODUCTS.items():
        x, weight = randn(rows, k), randn(n, k) * 0.02
        fp8 = quantize_fp8(weight)
        x_q, x_scale = fp8_rows.quantize_fp8_rows(x)
        times[f"{name}.bf16_mm"] = timed(lambda x=x, w=weight: torch.mm(x, w.t()))
        times[f"{name}.fp8_mm"] = timed(
            lambda q=x_q, s=x_scale, f=fp8: fp8_matmul.scaled_mm_fp8(q, s, f.weight, f.scale)
        )
        times[f"{name}.quantize_1pass"] = timed(lambda x=x: fp8_rows.quantize_fp8_rows(x))
        times[f"{name}.quantize_2pass"] = timed(lambda x=x: two_pass(x))
        del x, weight, fp8, x_q, x_scale
    hidden, residual, norm_weight = randn(rows, HIDDEN), randn(rows, HIDDEN), randn(HIDDEN)
    times["norm.bf16"] = timed(lambda: rms_norm.rms_norm(hidden, norm_weight, 1e-5, residual))
    times["norm.fp8"] = timed(
        lambda: rms_norm.rms_norm(hidden, norm_weight, 1e-5, residual, fp8_out=True)
    )
    gate_up = randn(rows, 2 * INNER)
    times["silu.bf16"] = timed(lambda: activation.silu_and_mul(gate_up))
    times["silu.fp8_fused"] = timed(lambda: fp8_rows.silu_and_mul_fp8(gate_up))

    layer = {
        "bf16": sum(times[f"{p}.bf16_mm"] for p in PRODUCTS) + 2 * times["norm.bf16"]
        + times["silu.bf16"],
        "fp8, two-pass quantize, unfused": sum(
            times[f"{p}.fp8_mm"] + times[f"{p}.quantize_2pass"] for p in PRODUCTS
        ) + 2 * times["norm.bf16"] + times["silu.bf16"],
        "fp8, one-pass quantize, silu fused": sum(times[f"{p}.fp8_mm"] for p in PRODUCTS)
        + sum(times[f"{p}.quantize_1pass"] for p in ("qkv", "o", "gate_up"))
        + 2 * times["norm.bf16"] + times["silu.fp8_fused"],
        "fp8, + norms quantizing": sum(times[f"{p}.fp8_mm"] for p in PRODUCTS)
        + times["o.quantize_1pass"] + 2 * times["norm.fp8"] + times["silu.fp8_fused"],
    }  # fmt: skip
    print(f"{'kernel':<24} {'us':>9}")
    for key, value in times.items():
        print(f"{key:<24} {value:>9.1f}")
    print(f"\none layer at {rows} rows, products + norms + activation + quantization:")
    for key, value in layer.items():
        print(f"  {key:<36} {value:>9.1f} us  ({layer['bf16'] / value:.3f}x bf16)")
    record = {
        "gpu": torch.cuda.get_device_name(device),
        "command": "PYTHONPATH=engine python bench/fp8_prompt_probe.py " + " ".join(argv),
        "rows": rows,
        "kernel_us": times,
        "layer_us": layer,
    }
    line = json.dumps(record)
    print(line)
    if args.output:
        with open(args.output, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
