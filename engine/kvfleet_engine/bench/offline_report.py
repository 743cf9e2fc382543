"""The offline benchmarks' report: row labels, the roofline's ceiling rows, the table printed
and the JSON written under --output-dir."""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet_engine.bench.offline_runner import Setup


def label(source: str, quantization: str) -> str:
    """Row source of one quantization's figures: kvfleet, kvfleet-fp8, roofline-awq, ..."""
    return source if quantization == "none" else f"{source}-{quantization}"


def ceiling_rows(s: Setup) -> list[Any]:
    from kvfleet_engine.bench.results import Row

    return [
        Row("roofline", "copy_bandwidth", s.ceilings.bandwidth / 1e9, "GB/s"),
        Row("roofline", "matmul_rate", s.ceilings.matmul_flops / 1e12, "TFLOP/s"),
        *(
            [Row("roofline", "fp8_matmul_rate", s.ceilings.fp8_matmul_flops / 1e12, "TFLOP/s")]
            if s.ceilings.fp8_matmul_flops
            else []
        ),
        *(
            Row(label("roofline", name), "weight_bytes_per_step", costs.weight_bytes / 1e9, "GB")
            for name, costs in s.costs.items()
        ),
    ]


def finish(
    args: argparse.Namespace,
    argv: list[str],
    what: str,
    s: Setup,
    workload: dict[str, Any],
    rows: list[Any],
) -> int:
    from kvfleet_engine.bench.results import format_table, gpu_name, write_results

    command = f"kvfleet bench {what} {shlex.join(argv)}"
    quantized = [name for name in args.quantization if name != "none"]
    path = write_results(
        args.output_dir,
        "-".join([what, args.shape, *quantized]),
        gpu_name(s.device),
        command,
        args.shape,
        workload,
        rows,
    )
    print(f"\n{command}\n{format_table(rows)}\nwrote {path}")
    return 0
