"""Decode CUDA graphs: bucket sizes, and greedy tokens identical with graphs on and off."""

from __future__ import annotations

import pytest
import torch

from kvfleet_engine.cuda_graphs import bucket_sizes


def test_bucket_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = bucket_sizes(256)
    assert sizes[-1] == 256 and sorted(sizes) == sizes
    assert all(any(s >= n for s in sizes) for n in range(1, 257))


def _greedy_tokens(directory, enforce_eager: bool, dtype: str) -> list[list[int]]:
    from kvfleet_engine import LLM, SamplingParams

    llm = LLM(
        str(directory),
        dtype=dtype,
        device="cuda",
        max_num_seqs=8,
        max_model_len=512,
        enforce_eager=enforce_eager,
    )
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(5 + 37 * i)] for i in range(6)]
    # Different lengths, so the batch shrinks through several graph sizes (with padding).
    params = [
        SamplingParams(temperature=0.0, max_tokens=20 + 9 * i, ignore_eos=True) for i in range(6)
    ]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_are_the_same_with_and_without_cuda_graphs(tmp_path, dtype) -> None:
    from kvfleet_engine.tiny_model import write_tiny_model

    write_tiny_model(tmp_path)
    eager = _greedy_tokens(tmp_path, enforce_eager=True, dtype=dtype)
    graphs = _greedy_tokens(tmp_path, enforce_eager=False, dtype=dtype)
    assert graphs == eager
