"""Does a decode step gain from running its attention (memory-bound) beside its products
(compute-bound at hundreds of rows)? bench/NOTES.md section 29.

At 512 rows of fp8 weights with an fp8 cache (the 1k/1k workload's decode steps), the products
need ≈ 5.6 ms of fp8 matrix rate and read 8 GB, while the attention reads ≈ 49 GB of cache at
≈ 1.5k tokens of context: in one stream they add up (24.5 ms a step measured); beside each other
the step could approach the bytes' time. The batch can only be split by rows: two halves, each
half's attention running while the other half's products run (NanoFlow's nano-batches). Each half
reads every weight, so the split costs the weights' bytes twice.

The probe times, for `--layers` layers of the 8B shape (one layer's weights and one cache reused
by every layer: each is larger than L2, so every layer reads DRAM), each in a CUDA graph:

  attention        the decode attention of all rows
  products         qkv, o, gate_up and down (SiLU in it) of all rows
  serial           per layer qkv, attention, o, gate_up, down: a step as the engine runs it
                   (norms, rotary and the residual adds left out)
  halves-serial    the same per half, one stream: what the split alone costs
  halves-overlap   the halves on two streams: half A's attention of layer L beside half B's
                   o / gate_up / down of layer L-1 and qkv of layer L, and half B's attention
                   beside half A's products; the schedule a nano-batched step would run
  concurrent       all attention on one stream beside all products on another, no order
                   between them: the most the GPU overlaps the two kernels' kinds at all

The Triton kernels launch with PDL unless KVFLEET_PDL=0 (`kernels.pdl`): a PDL kernel lets the
next one in its stream be scheduled at once, whose programs may then hold SMs while they wait.

`--green-sms N ...` asks the premise any split of the SMs rests on: does the attention keep its
bandwidth on fewer SMs? For each N, a CUDA green context of N SMs (`torch.cuda.green_contexts`)
runs the attention alone, then beside all the products on the ordinary stream (which may use
every SM), timed eagerly with events (graph capture across contexts is not relied on); the same
two without a green context, eagerly, are the baseline:

  eager-attention / eager-products / eager-concurrent      no green context
  green-N-attention                                        the attention on N SMs, alone
  green-N-concurrent                                       it beside the products

Eagerly the fp8 products are bound by the host's launches (39 ms a step against 6.7 in a graph,
H200), so only the attention's times (GPU-bound eagerly too) say anything there.

    python -m kvfleet_engine.bench.overlap_probe --rows 512 --context 1500 --weights fp8 \\
        --kv-cache-dtype fp8 [--output probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvfleet_engine.bench.gemv import graph_seconds, layer_shapes
from kvfleet_engine.kernels import pdl


@dataclass
class Case:
    """One layer's weights and one paged cache, and the step's activations for `rows` rows."""

    rows: int
    product: Callable[[str, slice], torch.Tensor]  # (product name, rows)
    attention: Callable[[slice], torch.Tensor]
    weights_per_row: int  # one layer's multiply-adds a row (its weights' count)
    weight_bytes: int  # one layer's
    kv_bytes: int  # one layer's attention over all rows


def build_case(shape: str, rows: int, context: int, weights: str, kv_cache: str) -> Case:
    from kvfleet_engine.bench.kernels import _kv_bytes, _paged_kv
    from kvfleet_engine.bench.shapes import SHAPES
    from kvfleet_engine.kernels import paged_decode_attention
    from kvfleet_engine.kernels.checks import to_token_major
    from kvfleet_engine.kernels.fp8_matmul import fp8_matmul, fp8_silu_and_mul_matmul
    from kvfleet_engine.quant.layout import quantize_fp8

    cfg = SHAPES[shape][1]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    device = torch.device("cuda")
    shapes = {name: (n, k) for name, n, k in layer_shapes(shape)}
    mats = {name: torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            for name, (n, k) in shapes.items()}  # fmt: skip
    scales: dict[str, torch.Tensor] = {}
    if weights == "fp8":
        for name, w in list(mats.items()):
            fp8 = quantize_fp8(w)
            mats[name], scales[name] = fp8.weight, fp8.scale
    xs = {k: torch.randn(rows, k, device=device, dtype=torch.bfloat16) for _, k in shapes.values()}
    gate_up_in = torch.randn(rows, shapes["gate_up"][0], device=device, dtype=torch.bfloat16)

    def product(name: str, part: slice) -> torch.Tensor:
        k = shapes[name][1]
        if name == "down":  # the engine's down reads [gate | up] and applies SiLU itself
            x = gate_up_in[part]
            if weights == "fp8":
                return fp8_silu_and_mul_matmul(x, mats[name], scales[name], torch.bfloat16)
            gate, up = x.chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, mats[name])
        x = xs[k][part]
        if weights == "fp8":
            return fp8_matmul(x, mats[name], scales[name], torch.bfloat16)
        return F.linear(x, mats[name])

    k_cache, v_cache, block_tables, lens, kv_scales = _paged_kv(
        rows, context, kv_heads, head_dim, 16, kv_cache
    )
    if kv_cache != "auto":
        v_cache = to_token_major(v_cache)
    query = torch.randn(rows, heads, head_dim, device=device, dtype=torch.bfloat16)

    def attention(part: slice) -> torch.Tensor:
        return paged_decode_attention(
            query[part], k_cache, v_cache, block_tables[part], lens[part], head_dim**-0.5,
            **kv_scales,
        )  # fmt: skip

    count = sum(n * k for n, k in shapes.values())
    weight_bytes = count * (1 if weights == "fp8" else 2)
    kv_bytes = _kv_bytes(rows * context, kv_heads, head_dim, kv_cache != "auto")
    return Case(rows, product, attention, count, weight_bytes, kv_bytes)


QKV, REST = ("qkv",), ("o", "gate_up", "down")


def variants(case: Case, layers: int) -> dict[str, Callable[[], None]]:
    full, a, b = slice(None), slice(0, case.rows // 2), slice(case.rows // 2, None)
    side = torch.cuda.Stream()  # made once, outside any capture

    def products(part: slice, names: tuple[str, ...]) -> None:
        for name in names:
            case.product(name, part)

    def attention() -> None:
        for _ in range(layers):
            case.attention(full)

    def all_products() -> None:
        for _ in range(layers):
            products(full, QKV + REST)

    def serial() -> None:
        for _ in range(layers):
            products(full, QKV)
            case.attention(full)
            products(full, REST)

    def halves_serial() -> None:
        for _ in range(layers):
            for part in (a, b):
                products(part, QKV)
                case.attention(part)
                products(part, REST)

    def halves_overlap() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)

        def mark(stream: torch.cuda.Stream) -> torch.cuda.Event:
            event = torch.cuda.Event()
            event.record(stream)
            return event

        products(a, QKV)
        qkv_a = mark(main)
        for layer in range(layers):
            with torch.cuda.stream(side):
                side.wait_event(qkv_a)
                case.attention(a)
                attn_a = mark(side)
            if layer:
                products(b, REST)  # half B's previous layer, beside half A's attention
            products(b, QKV)
            qkv_b = mark(main)
            with torch.cuda.stream(side):
                side.wait_event(qkv_b)
                case.attention(b)
                attn_b = mark(side)
            main.wait_event(attn_a)
            products(a, REST)  # half A's, beside half B's attention
            if layer + 1 < layers:
                products(a, QKV)
                qkv_a = mark(main)
        main.wait_event(attn_b)
        products(b, REST)
        main.wait_stream(side)

    def concurrent() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            attention()
        all_products()
        main.wait_stream(side)

    return {
        "attention": attention,
        "products": all_products,
        "serial": serial,
        "halves-serial": halves_serial,
        "halves-overlap": halves_overlap,
        "concurrent": concurrent,
    }


def eager_ms(step: Callable[[], None]) -> float:
    """Mean milliseconds of step() launched eagerly, 5 times back to back after a warm-up."""
    from kvfleet_engine.bench.roofline import back_to_back_seconds

    return back_to_back_seconds(step, repeats=5) * 1e3


def green_times(case: Case, layers: int, sms: list[int]) -> dict[str, float | str]:
    """The eager baseline, then the attention confined to a green context of each SM count,
    alone and beside the products (the module docstring). An SM count the GPU or the driver
    refuses gives its error as the value."""
    steps = variants(case, layers)
    attention, products = steps["attention"], steps["products"]

    def attention_on(stream: torch.cuda.Stream, main_work: bool) -> Callable[[], None]:
        """The attention on `stream`, forked from and joined back to the current stream, with
        the products on the current stream between (main_work) or nothing there."""

        def step() -> None:
            main = torch.cuda.current_stream()
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                attention()
            if main_work:
                products()
            main.wait_stream(stream)

        return step

    times: dict[str, float | str] = {
        "eager-attention": eager_ms(attention),
        "eager-products": eager_ms(products),
        "eager-concurrent": eager_ms(steps["concurrent"]),
    }
    from torch.cuda.green_contexts import GreenContext

    for count in sms:
        try:
            context: Any = GreenContext.create(count, torch.cuda.current_device())
            made = context.Stream()  # a torch.Stream: wrapped as the CUDA stream it is
            stream = torch.cuda.Stream(
                stream_id=made.stream_id, device_index=made.device_index,
                device_type=made.device_type,
            )  # fmt: skip
            times[f"green-{count}-attention"] = eager_ms(attention_on(stream, main_work=False))
            times[f"green-{count}-concurrent"] = eager_ms(attention_on(stream, main_work=True))
        except Exception as error:  # the probe reports what the driver refused, and goes on
            times[f"green-{count}-attention"] = f"{type(error).__name__}: {error}"[:200]
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.overlap_probe")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[512])
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="fp8")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--output", help="JSON of every (rows, variant) time")
    parser.add_argument(
        "--green-sms", type=int, nargs="+", default=[],
        help="also time the attention confined to a green context of each of these SM counts, "
        "alone and beside the products (eagerly)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("overlap_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from kvfleet_engine.bench.roofline import measure_ceilings

    ceilings = measure_ceilings(torch.device("cuda"))
    bandwidth = ceilings.bandwidth
    rate = ceilings.matmul_flops
    if args.weights == "fp8":
        if ceilings.fp8_matmul_flops is None:
            print("overlap_probe: --weights fp8 needs a GPU with fp8 products", file=sys.stderr)
            return 2
        rate = ceilings.fp8_matmul_flops
    on = pdl.enabled(torch.device("cuda"))  # the Triton kernels' launches (KVFLEET_PDL)
    print(
        f"copy {bandwidth / 1e9:.0f} GB/s, {args.weights} matrix rate {rate / 1e12:.0f} TFLOP/s, "
        f"Triton kernels {'with' if on else 'without'} PDL ({pdl.PDL_ENV})"
    )
    results = []
    for rows in args.rows:
        case = build_case(args.shape, rows, args.context, args.weights, args.kv_cache_dtype)
        flops = 2 * rows * case.weights_per_row * args.layers
        bytes_ = (case.weight_bytes + case.kv_bytes) * args.layers
        floor = max(bytes_ / bandwidth, flops / rate)
        print(
            f"rows {rows}, context {args.context}: bytes {bytes_ / 1e9:.1f} GB "
            f"({bytes_ / bandwidth * 1e3:.2f} ms at copy), products {flops / rate * 1e3:.2f} ms "
            f"at the matrix rate; floor {floor * 1e3:.2f} ms"
        )
        times = {}
        for name, step in variants(case, args.layers).items():
            times[name] = graph_seconds(step) * 1e3
            print(f"  {name:15} {times[name]:8.3f} ms", flush=True)
        if args.green_sms:
            for name, value in green_times(case, args.layers, args.green_sms).items():
                times[name] = value  # type: ignore[assignment]
                shown = f"{value:8.3f} ms" if isinstance(value, float) else value
                print(f"  {name:22} {shown}", flush=True)
        gain = times["serial"] / times["halves-overlap"]
        print(f"  serial / halves-overlap {gain:.3f}; concurrent / (attention + products) "
              f"{times['concurrent'] / (times['attention'] + times['products']):.3f}")  # fmt: skip
        results.append({"rows": rows, "context": args.context, "floor_ms": floor * 1e3, **times})
    if args.output:
        with open(args.output, "w") as f:
            arguments = " ".join(argv or sys.argv[1:])
            command = f"python -m kvfleet_engine.bench.overlap_probe {arguments}"
            json.dump({"gpu": torch.cuda.get_device_name(), "command": command,
                       "weights": args.weights, "kv_cache_dtype": args.kv_cache_dtype,
                       "pdl": on,
                       "copy_gb_per_s": bandwidth / 1e9, "matrix_tflop_per_s": rate / 1e12,
                       "results": results}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
