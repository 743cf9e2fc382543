"""CUDA graphs (decode steps, short prompt steps): bucket sizes, and greedy tokens identical with
graphs on and off, and with programmatic dependent launch on and off."""

from __future__ import annotations

import pytest
import torch

from kvfleet_engine.cuda_graphs import PROMPT_GRAPH_MAX_TOKENS, bucket_sizes, prompt_bucket_sizes


def test_bucket_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = bucket_sizes(256)
    assert sizes[-1] == 256 and sorted(sizes) == sizes
    assert all(any(s >= n for s in sizes) for n in range(1, 257))


def test_prompt_bucket_sizes_cover_every_step_up_to_the_limit_with_little_padding() -> None:
    assert prompt_bucket_sizes(48) == [16, 32, 48]
    sizes = prompt_bucket_sizes(8192)
    assert sizes[:5] == [16, 32, 64, 128, 192] and sizes[-1] == PROMPT_GRAPH_MAX_TOKENS
    assert sorted(sizes) == sizes
    for n in range(129, PROMPT_GRAPH_MAX_TOKENS + 1):
        size = next(s for s in sizes if s >= n)
        assert size - n < (64 if n <= 512 else 128), n


def _greedy_tokens(
    directory,
    enforce_eager: bool,
    dtype: str,
    max_num_batched_tokens: int,
    quantization: str | None = None,
) -> list[list[int]]:
    from kvfleet_engine import LLM, SamplingParams

    llm = LLM(
        str(directory),
        dtype=dtype,
        device="cuda",
        max_num_seqs=8,
        max_model_len=512,
        max_num_batched_tokens=max_num_batched_tokens,
        enforce_eager=enforce_eager,
        quantization=quantization,
    )
    assert (llm.engine.model_runner.executor.prompt_graphs is None) == enforce_eager
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(5 + 37 * i)] for i in range(6)]
    # Different lengths, so the batch shrinks through several graph sizes (with padding).
    params = [
        SamplingParams(temperature=0.0, max_tokens=20 + 9 * i, ignore_eos=True) for i in range(6)
    ]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    # Again with a shared 64-token head: the cached prefix's blocks, then the rest as prompts.
    again = [prompts[-1][:64] + p for p in prompts[:4]]
    outputs += llm.generate(prompt_token_ids=again, sampling_params=params[:4], use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
# 8192: every prompt in the first step; 48: chunks beside decodes (mixed steps, with the async
# scheduler's pending tokens among them).
@pytest.mark.parametrize("max_num_batched_tokens", [8192, 48])
def test_greedy_tokens_are_the_same_with_and_without_cuda_graphs(
    tmp_path, dtype, max_num_batched_tokens
) -> None:
    from kvfleet_engine.tiny_model import write_tiny_model

    write_tiny_model(tmp_path)
    eager = _greedy_tokens(tmp_path, True, dtype, max_num_batched_tokens)
    graphs = _greedy_tokens(tmp_path, False, dtype, max_num_batched_tokens)
    assert graphs == eager


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8", "int8"])
def test_greedy_tokens_are_the_same_with_and_without_programmatic_dependent_launch(
    tmp_path, monkeypatch, quantization
) -> None:
    """PDL changes when a kernel starts, never what it reads: the tokens of graphs and mixed
    steps (48 tokens per step) are identical with it off and on."""
    from kvfleet_engine.kernels import pdl
    from kvfleet_engine.tiny_model import write_tiny_model

    write_tiny_model(tmp_path)
    tokens = []
    for setting in ("0", "1"):
        monkeypatch.setenv(pdl.PDL_ENV, setting)
        pdl.enabled.cache_clear()
        tokens.append(_greedy_tokens(tmp_path, False, "bfloat16", 48, quantization))
        assert pdl.enabled(torch.device("cuda")) == (
            setting == "1" and torch.cuda.get_device_capability() >= (9, 0)
        )
    pdl.enabled.cache_clear()
    assert tokens[1] == tokens[0]


@pytest.mark.gpu
def test_pdl_is_on_by_default_for_quantized_linears_only(tmp_path, monkeypatch) -> None:
    """Float linears run cuBLAS products, slower with PDL on the H200; quantized ones ours."""
    from kvfleet_engine import LLM
    from kvfleet_engine.kernels import pdl
    from kvfleet_engine.tiny_model import write_tiny_model

    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    write_tiny_model(tmp_path)
    for quantization, expected in ((None, False), ("fp8", True)):
        llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", max_model_len=256,
                  quantization=quantization)  # fmt: skip
        capable = torch.cuda.get_device_capability() >= (9, 0)
        assert pdl.enabled(torch.device("cuda")) == (expected and capable), quantization
        del llm
    pdl.set_default(True)
