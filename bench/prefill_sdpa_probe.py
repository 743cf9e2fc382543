"""A prompt step's attention: the engine's paged prefill kernel against torch's
scaled_dot_product_attention backends (flash, cuDNN, memory-efficient) on the same fresh prompts,
bf16, Llama-3.1-8B heads (32 query, 8 KV, dim 128), causal. SDPA reads contiguous K/V (no block
table, no cached prefix): an upper bound on what routing whole fresh prompts to it would give.

    PYTHONPATH=engine python bench/prefill_sdpa_probe.py --output probe.json
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
import triton
from gpu_probe import write_record
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvfleet_engine.bench.kernels import _paged_kv
from kvfleet_engine.kernels import prefill_attention

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SHAPES = ((8, 1024), (4, 3968), (32, 512))  # (prompts, tokens each)
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def kvfleet_ms(num_seqs: int, q_len: int) -> float:
    k_cache, v_cache, block_tables, _, _ = _paged_kv(
        num_seqs, q_len, KV_HEADS, HEAD_DIM, BLOCK, "auto"
    )
    query = torch.randn(num_seqs * q_len, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (num_seqs + 1) * q_len, q_len, device="cuda", dtype=torch.int32)
    lens = torch.full((num_seqs,), q_len, device="cuda", dtype=torch.int32)
    run = functools.partial(
        prefill_attention, query, k_cache, v_cache, block_tables, cu, lens, HEAD_DIM**-0.5
    )
    return triton.testing.do_bench(run, return_mode="median")


def sdpa_ms(num_seqs: int, q_len: int, backend: SDPBackend) -> float:
    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(num_seqs, heads, q_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    q, k, v = tensor(Q_HEADS), tensor(KV_HEADS), tensor(KV_HEADS)
    with sdpa_kernel(backend):
        run = functools.partial(
            F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True
        )
        return triton.testing.do_bench(run, return_mode="median")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: TFLOP/s (causal)")
    print(f"{'prompts':<12} {'kvfleet':>8} " + " ".join(f"{name:>9}" for name in BACKENDS))
    table: dict[str, dict[str, float | str]] = {}
    for num_seqs, q_len in SHAPES:
        flops = num_seqs * Q_HEADS * 4 * HEAD_DIM * q_len * q_len / 2
        rates: dict[str, float | str] = {"kvfleet": flops / kvfleet_ms(num_seqs, q_len) / 1e9}
        for name, backend in BACKENDS.items():
            try:
                rates[name] = flops / sdpa_ms(num_seqs, q_len, backend) / 1e9
            except RuntimeError as error:  # a backend that does not take these inputs
                rates[name] = f"unavailable: {str(error).splitlines()[0][:120]}"
        label = f"{num_seqs} x {q_len}"
        table[label] = rates
        cells = [f"{r:>9.1f}" if isinstance(r, float) else f"{'-':>9}" for r in rates.values()]
        print(f"{label:<12} " + " ".join(cells))
    write_record(args.output, {"tflops": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
