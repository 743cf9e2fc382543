"""The ceilings, measured at the start of a run (METHOD.md): copy bandwidth (bytes read +
written by a large device-to-device copy), the bf16 matrix-product rate and, on a GPU with fp8
(compute capability 8.9 and up), the e4m3 one; and the ideal times of decode and prefill they
imply. Products of fp8 (W8A8) weights are held to the fp8 rate, every other kind to bf16's."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s, read + written, large device-to-device copy
    matmul_flops: float  # FLOP/s, square bf16 matrix product
    fp8_matmul_flops: float | None = None  # FLOP/s, square e4m3 product; None: no fp8 here

    def matmul_rate(self, fp8_products: bool) -> float:
        """The rate a model's products are held to: fp8's where its products are fp8 and the
        GPU has them, bf16's otherwise."""
        if fp8_products and self.fp8_matmul_flops is not None:
            return self.fp8_matmul_flops
        return self.matmul_flops


def time_median(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Median seconds of fn() after two warm-up calls."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def back_to_back_seconds(fn: Callable[[], object], repeats: int = 50) -> float:
    """Mean device seconds of fn() (GPU work only) queued `repeats` times back to back between
    two CUDA events, after one warm-up call: the cadence of an engine that keeps the GPU fed."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / repeats


def measure_ceilings(device: torch.device) -> Ceilings:
    on_gpu = device.type == "cuda"
    numel = (1 << 30) if on_gpu else (1 << 24)  # 2 GiB of bf16 per buffer on the GPU
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = time_median(lambda: dst.copy_(src), device, repeats=20)
    bandwidth = 2 * src.numel() * src.element_size() / copy_s
    n = 8192 if on_gpu else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_s = time_median(lambda: a @ b, device)
    fp8_flops = None  # a GPU without fp8 products: none
    if on_gpu and torch.cuda.get_device_capability(device) >= (8, 9):
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm needs
        one = torch.ones((), device=device)

        def fp8_product() -> torch.Tensor:  # fast accumulation, as the engine's fp8 products
            return torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)

        fp8_s = time_median(fp8_product, device)
        fp8_flops = 2 * n**3 / fp8_s
    return Ceilings(bandwidth, matmul_flops=2 * n**3 / matmul_s, fp8_matmul_flops=fp8_flops)


@dataclass(frozen=True)
class ModelCosts:
    weight_bytes: int  # weights read per decode step (packed, for quantized weights)
    kv_bytes_per_token: int  # K and V of one token, all layers
    # Multiply-adds per token in the weight matrices; None: weight_bytes / 2 (bf16 weights).
    weights_per_token: int | None = None
    # W8A8: the products run at the fp8 matrix rate (all of them: the bf16 LM head, ~7% of the
    # 8B shape's, is counted at fp8's too, so the ideal is a few percent short)
    fp8_products: bool = False

    @property
    def flops_per_token(self) -> float:  # matmul FLOPs per token (2 per weight)
        if self.weights_per_token is None:
            return float(self.weight_bytes)
        return 2.0 * self.weights_per_token


def decode_step_seconds(costs: ModelCosts, ceilings: Ceilings, batch: int, context: float) -> float:
    """Ideal decode step: weights once (or the batch's matmul FLOPs, if more) plus each
    sequence's KV at the measured bandwidth."""
    weights = max(
        costs.weight_bytes / ceilings.bandwidth,
        batch * costs.flops_per_token / ceilings.matmul_rate(costs.fp8_products),
    )
    return weights + batch * context * costs.kv_bytes_per_token / ceilings.bandwidth


def offline_seconds(
    costs: ModelCosts,
    ceilings: Ceilings,
    input_lens: list[int],
    output_len: int,
    max_batch: int,
) -> float:
    """Ideal time for an offline workload: every prompt token at the matmul rate, then decode in
    waves of max_batch sequences, each step at decode_step_seconds for its mean context."""
    prefill = sum(input_lens) * costs.flops_per_token / ceilings.matmul_rate(costs.fp8_products)
    decode = 0.0
    for start in range(0, len(input_lens), max_batch):
        wave = input_lens[start : start + max_batch]
        mean_input = sum(wave) / len(wave)
        for step in range(output_len - 1):  # the first token comes from the prefill
            decode += decode_step_seconds(costs, ceilings, len(wave), mean_input + step + 1)
    return prefill + decode
