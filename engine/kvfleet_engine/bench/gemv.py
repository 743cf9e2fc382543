"""A decode step's matrix products under cuBLAS call variants and settings: which reads the
weights fastest at one token, and which kernels each launches (cuBLAS splits K for the
4096-wide outputs and adds a reduce kernel per product); `--tokens` adds larger batches, to see
that a setting that helps one token does not slow prompt steps.

Each variant runs the decoder's four products for every layer (distinct weights per layer, so
nothing stays in L2) as one CUDA graph, against the time the same bytes take at the measured copy
bandwidth.

    python -m kvfleet_engine.bench.gemv --shape llama-3.1-8b --tokens 1,256,16384
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvfleet_engine.bench.results import Row, gpu_name, write_results
from kvfleet_engine.bench.shapes import SHAPES

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [1, K], weight [N, K])

_ZERO_BIAS: dict[int, torch.Tensor] = {}


def _linear_bias(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear with a zero bias: PyTorch sends products with a bias to cuBLASLt (its own
    heuristics and workspace, CUBLASLT_WORKSPACE_SIZE) instead of cuBLAS."""
    n = w.shape[0]
    if n not in _ZERO_BIAS:
        _ZERO_BIAS[n] = torch.zeros(n, device=w.device, dtype=w.dtype)
    return F.linear(x, w, _ZERO_BIAS[n])


VARIANTS: dict[str, Product] = {
    "linear": lambda x, w: F.linear(x, w),
    "mv": lambda x, w: torch.mv(w, x[0]),
    "weight@x.T": lambda x, w: w @ x.t(),
    "linear+bias": _linear_bias,
}
# The engine's default (kvfleet_engine/__init__: no cuBLAS or cuBLASLt workspace), and both
# with a workspace, in which cuBLAS may split K (a reduce kernel after the product).
WORKSPACE_ON = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUBLASLT_WORKSPACE_SIZE": "32768"}


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median seconds of one replay of a captured (and warmed-up) CUDA graph."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def capture_graph(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`step` run once (compiles outside capture), captured in a CUDA graph, replayed 3 times."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    return graph


def graph_seconds(step: Callable[[], object], replays: int = 15) -> float:
    """Median time of one replay of `step` captured in a CUDA graph."""
    return replay_seconds(capture_graph(step), replays)


def layer_shapes(shape: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decoder layer's products: qkv, o, gate_up, down."""
    cfg = SHAPES[shape][1]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    return [
        ("qkv", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o", hidden, heads * head_dim),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
    ]


def run_variant(shape: str, name: str, layers: int, tokens: int) -> dict[str, float | str]:
    device = torch.device("cuda")
    product = VARIANTS[name]
    shapes = layer_shapes(shape)
    weights = [
        [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _, n, k in shapes]
        for _ in range(layers)
    ]
    xs = {k: torch.randn(tokens, k, device=device, dtype=torch.bfloat16) for _, _, k in shapes}

    def step() -> None:
        for layer in weights:
            for (_, _, k), w in zip(shapes, layer, strict=True):
                product(xs[k], w)

    graph = capture_graph(step)
    seconds = replay_seconds(graph, 20)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[f"{event.count} x {event.key[:70]}"] += event.self_device_time_total / 1e3
    weight_bytes = sum(n * k * 2 for _, n, k in shapes) * layers
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:4]
    return {
        "variant": name,
        "tokens": tokens,
        "ms": seconds * 1e3,
        "tflop_per_s": weight_bytes * tokens / seconds / 1e12,  # 2 FLOPs per bf16 weight
        "weight_gb_per_s": weight_bytes / seconds / 1e9,
        "kernels": "; ".join(f"{key}: {ms:.3f} ms" for key, ms in top),
    }


def result_rows(runs: list[dict[str, Any]], bandwidth: float) -> list[Row]:
    """The runs as result rows: milliseconds per step of products, per batch and variant."""
    rows = [Row("roofline", "copy_bandwidth", bandwidth / 1e9, "GB/s")]
    for run in runs:
        setting = "_workspace_on" if run["env"] else ""
        metric = f"matmul_step_ms_t{run['tokens']}_{run['variant']}{setting}"
        rows.append(Row("kvfleet", metric, run["ms"], "ms"))
    return rows


def copy_bandwidth() -> float:
    from kvfleet_engine.bench.roofline import measure_ceilings

    return measure_ceilings(torch.device("cuda")).bandwidth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.gemv")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", default="1", help="comma-separated batch sizes (rows of x)")
    parser.add_argument("--variant", help="run one variant in this process and print its row")
    parser.add_argument("--output-dir", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.variant:
        print(json.dumps(run_variant(args.shape, args.variant, args.layers, int(args.tokens))))
        return 0
    bandwidth = copy_bandwidth()
    weight_bytes = sum(n * k * 2 for _, n, k in layer_shapes(args.shape)) * args.layers
    print(
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s: {weight_bytes / bandwidth * 1e3:.3f} ms ideal"
    )
    runs: list[tuple[str, dict[str, str]]] = [(name, {}) for name in VARIANTS]
    runs += [("linear", WORKSPACE_ON), ("linear+bias", WORKSPACE_ON)]
    rows = []
    for tokens in (int(n) for n in args.tokens.split(",")):
        for name, env in runs if tokens == 1 else [r for r in runs if "linear" in r[0]]:
            cmd = [sys.executable, "-m", "kvfleet_engine.bench.gemv", "--shape", args.shape]
            cmd += ["--layers", str(args.layers), "--variant", name, "--tokens", str(tokens)]
            # Each in a fresh process: cuBLAS settings are read once, when its handle is made.
            out = subprocess.run(
                cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False
            )
            if out.returncode != 0:
                print(f"{name} {env}: failed: {out.stderr[-500:]}")
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["env"] = " ".join(f"{k}={v}" for k, v in env.items())
            row["of_copy"] = row["weight_gb_per_s"] * 1e9 / bandwidth
            rows.append(row)
            print(
                f"{tokens:6} {name:11} {row['env']:32} {row['ms']:8.3f} ms "
                f"{row['of_copy']:6.1%} of copy {row['tflop_per_s']:6.1f} TFLOP/s  "
                f"{row['kernels']}",
                flush=True,
            )
    if args.output_dir:
        path = write_results(
            args.output_dir,
            f"gemv-variants-{args.shape}",
            gpu_name(torch.device("cuda")),
            "python -m kvfleet_engine.bench.gemv " + shlex.join(argv or sys.argv[1:]),
            args.shape,
            {"layers": args.layers, "tokens": args.tokens, "runs": rows},
            result_rows(rows, bandwidth),
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
