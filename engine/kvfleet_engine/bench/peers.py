"""The `transformers` peer on the same weights and workload: `generate` (static batch, here
batch-1 decode) and `generate_batch` (its continuous batching)."""

from __future__ import annotations

import time
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate_decode_rate(model: Any, prompt: list[int], output_len: int) -> float:
    """Decode tokens/s of `generate` at batch 1: (output_len - 1) tokens over the time a
    output_len-token call takes beyond a 1-token call (which is prefill plus the first token)."""
    device = model.device
    input_ids = torch.tensor([prompt], device=device)

    def run(num_tokens: int) -> float:
        _sync(device)
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
        )
        _sync(device)
        assert out.shape[1] == len(prompt) + num_tokens
        return time.perf_counter() - start

    run(4)  # warm-up
    first = run(1)
    full = run(output_len)
    return (output_len - 1) / (full - first)


# No inference_mode here: it is per thread, and generate_batch allocates its cache in this
# thread but updates it in place from its worker thread, which then fails ("Inplace update to
# inference tensor outside InferenceMode", H200 run of 2026-11-29).
def generate_batch_throughput(
    model: Any, prompts: list[list[int]], output_len: int
) -> tuple[float, int]:
    """(output tokens/s, output tokens) of `generate_batch` on the prompts (greedy)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None)
    model.generate_batch(inputs=prompts[:4], generation_config=config, progress_bar=False)
    _sync(model.device)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=True)
    _sync(model.device)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(out.generated_tokens) for out in outputs.values())
    if num_tokens == 0:  # its background thread died; it logs why and returns nothing
        raise RuntimeError("generate_batch returned no tokens (see its ERROR log lines)")
    return num_tokens / elapsed, num_tokens
