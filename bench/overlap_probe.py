"""Would two half-batches on two streams beat one batch at c256? (NOTES section 21.)

A served c256 decode step (Llama-3.1-8B shape, 256 rows, context 640) spends 6.3 ms in bf16
products (compute-bound, ~610 TFLOP/s) and 5.8 ms in decode attention (memory-bound, 88% of
copy bandwidth), one after the other. Two micro-batches of 128 rows on two streams let one
half's attention run beside the other half's products. This probe times 32 layers of
(qkv, attention, o, gate_up, silu * up, down) captured in CUDA graphs, random weights and KV:

  serial       one stream, 256 rows (the engine today)
  products     the products alone, 256 rows; attention: the attention alone, 256 rows
  two-streams  two streams of 128 rows each, forked and joined once per step
  per product  each product alone at 256 and 128 rows (TFLOP/s), cuBLAS through F.linear

    python bench/overlap_probe.py [--batch 256] [--context 640] [--output probe.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, BLOCK = 4096, 32, 8, 128, 14336, 32, 16


def graph_ms(fn: Callable[[], None], reps: int = 20) -> float:
    """Median ms of one replay of fn captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile Triton kernels, warm cuBLAS
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


class Layer:
    """One layer's bf16 weights and a paged KV cache for `batch` sequences of `context` tokens."""

    def __init__(self, batch: int, context: int) -> None:
        def weight(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02

        self.qkv = weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        self.o = weight(HIDDEN, HEADS * HEAD_DIM)
        self.gate_up = weight(2 * FFN, HIDDEN)
        self.down = weight(HIDDEN, FFN)
        per_seq = -(-context // BLOCK)
        shape = (batch * per_seq, BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        order = torch.randperm(batch * per_seq, device="cuda").to(torch.int32)
        self.block_tables = order.view(batch, per_seq).contiguous()
        self.context_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)


def forward(layers: list[Layer], x: torch.Tensor, rows: slice, parts: str = "all") -> None:
    """32 layers over rows `rows` of the batch: the products, the attention, or both."""
    from kvfleet_engine.kernels import paged_decode_attention
    from kvfleet_engine.kernels.activation import silu_and_mul

    h = x[rows]
    n = h.shape[0]
    for layer in layers:
        if parts != "attention":
            qkv = F.linear(h, layer.qkv)
            q = qkv[:, : HEADS * HEAD_DIM].reshape(n, HEADS, HEAD_DIM)
        else:
            q = h[:, : HEADS * HEAD_DIM].reshape(n, HEADS, HEAD_DIM)
        if parts != "products":
            attn = paged_decode_attention(
                q.contiguous(), layer.k_cache, layer.v_cache, layer.block_tables[rows],
                layer.context_lens[rows], HEAD_DIM**-0.5,
            )  # fmt: skip
            a = attn.reshape(n, HEADS * HEAD_DIM)
        else:
            a = q.reshape(n, HEADS * HEAD_DIM)
        if parts == "attention":
            continue
        h = F.linear(a, layer.o)
        h = F.linear(silu_and_mul(F.linear(h, layer.gate_up)), layer.down)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--output", default="overlap_probe.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    batch = args.batch
    layers = [Layer(batch, args.context) for _ in range(LAYERS)]
    x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
    whole, first, second = slice(0, batch), slice(0, batch // 2), slice(batch // 2, batch)
    side = torch.cuda.Stream()

    def two_streams() -> None:
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        forward(layers, x, first)
        with torch.cuda.stream(side):
            forward(layers, x, second)
        main_stream.wait_stream(side)

    results: dict[str, float] = {
        "serial_ms": graph_ms(lambda: forward(layers, x, whole)),
        "products_ms": graph_ms(lambda: forward(layers, x, whole, "products")),
        "attention_ms": graph_ms(lambda: forward(layers, x, whole, "attention")),
        "half_serial_ms": graph_ms(lambda: forward(layers, x, first)),
        "two_streams_ms": graph_ms(two_streams),
    }
    shapes = {"qkv": layers[0].qkv, "o": layers[0].o, "gate_up": layers[0].gate_up,
              "down": layers[0].down}  # fmt: skip
    for rows in (batch, batch // 2):
        for name, w in shapes.items():
            a = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
            ms = graph_ms(lambda a=a, w=w: [F.linear(a, w) for _ in range(LAYERS)]) / LAYERS
            results[f"{name}_m{rows}_us"] = ms * 1e3
            results[f"{name}_m{rows}_tflops"] = 2 * rows * w.numel() / (ms * 1e-3) / 1e12
    for key, value in results.items():
        print(f"{key:<24} {value:10.3f}")
    saving = 1 - results["two_streams_ms"] / results["serial_ms"]
    print(f"two streams against one: {saving:+.1%} of the step")
    record = {
        "gpu": torch.cuda.get_device_name(),
        "command": f"python bench/overlap_probe.py --batch {batch} --context {args.context}",
        "results": results,
    }
    with open(args.output, "w") as handle:
        json.dump(record, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
