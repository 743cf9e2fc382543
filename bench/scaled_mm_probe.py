"""fp8 products at a prompt step's rows: torch._scaled_mm with per-row x per-column scales (what
the engine's W8A8 linears call) against one scale per tensor, and bf16's mm, for each product of
a Llama-3.1-8B layer. Does the rowwise kernel, not fp8 itself, hold the products at 1.43-1.75x
bf16 (bench/NOTES.md section 21)?

    PYTHONPATH=engine python bench/scaled_mm_probe.py --rows 16384 --output probe.json
"""

from __future__ import annotations

import argparse
import functools

import torch
from gpu_probe import time_us, write_record

from kvfleet_engine.kernels.fp8_matmul import triton_fp8_gemm

# (name, K, N) of one Llama-3.1-8B layer's products.
PRODUCTS = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096))


# Each variant's time in microseconds; the fp8 ones also as bf16's time over theirs.
KEYS = ("bf16", "rowwise", "rowwise_fast", "tensorwise", "tensorwise_fast", "triton")


def print_row(name: str, times: dict[str, float]) -> None:
    cells = [f"{times[key]:>9.1f}" for key in KEYS]
    cells += [f"{times['bf16'] / times[key]:>7.2f}x" for key in KEYS[1:]]
    print(f"{name:<8} " + " ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--output")
    args = parser.parse_args()
    dev = torch.device("cuda")
    fp8 = torch.float8_e4m3fn
    rows = args.rows
    table: dict[str, dict[str, float]] = {}
    errors: dict[str, dict[str, float]] = {name: {} for name, _, _ in PRODUCTS}
    print(f"{torch.cuda.get_device_name()}, {rows} rows, torch {torch.__version__}")
    print(f"{'product':<8} " + " ".join(f"{key[:9]:>9}" for key in KEYS) + "  (us; x bf16)")
    mm, scaled_mm = torch.mm, functools.partial(torch._scaled_mm, out_dtype=torch.bfloat16)
    one = torch.ones((), device=dev, dtype=torch.float32)
    for name, k, n in PRODUCTS:
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        xq, wt = x.to(fp8), w.to(fp8).t()  # column-major [K, N], as _scaled_mm takes it
        sx = torch.rand(rows, 1, device=dev, dtype=torch.float32) + 0.5
        sw = torch.rand(1, n, device=dev, dtype=torch.float32) + 0.5
        table[name] = {
            "bf16": time_us(functools.partial(mm, x, w.t())),
            "rowwise": time_us(functools.partial(scaled_mm, xq, wt, sx, sw)),
            "rowwise_fast": time_us(
                functools.partial(scaled_mm, xq, wt, sx, sw, use_fast_accum=True)
            ),
            "tensorwise": time_us(functools.partial(scaled_mm, xq, wt, one, one)),
            "tensorwise_fast": time_us(
                functools.partial(scaled_mm, xq, wt, one, one, use_fast_accum=True)
            ),
            # The engine's Triton W8A8 GEMM (its choice up to fp8_matmul.BATCH_MAX_ROWS rows).
            "triton": time_us(
                functools.partial(triton_fp8_gemm, xq, sx, wt.t(), sw.view(-1), torch.bfloat16)
            ),
        }
        print_row(name, table[name])
        # What fast accumulation costs in accuracy: each variant's relative error (Frobenius)
        # against the float32 product of the same e4m3 operands and scales.
        reference = (xq.float() * sx) @ (wt.float() * sw)
        for key, fast in (("rowwise", False), ("rowwise_fast", True)):
            got = scaled_mm(xq, wt, sx, sw, use_fast_accum=fast).float()
            errors[name][key] = ((got - reference).norm() / reference.norm()).item()
        del reference
        print(
            f"{'':<8} relative error: rowwise {errors[name]['rowwise']:.2e}, "
            f"fast {errors[name]['rowwise_fast']:.2e}"
        )
    total = {key: sum(t[key] for t in table.values()) for key in KEYS}
    print_row("layer", total)
    write_record(
        args.output,
        {"rows": rows, "products": table, "layer": total, "relative_error_vs_float32": errors},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
