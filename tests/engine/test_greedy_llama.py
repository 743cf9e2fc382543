"""The engine's greedy tokens equal transformers' on the same tiny random Llama, on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_cases import assert_greedy_equal, random_prompts, reference_greedy, write_checkpoint

from kvfleet_engine import LLM, SamplingParams

LENGTHS = [1, 2, 15, 16, 17, 40, 100, 300]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    directory = tmp_path_factory.mktemp("llama3")
    return directory, write_checkpoint("llama3", directory)


def test_llama_greedy_batch_matches_transformers(llama: tuple[Path, object]) -> None:
    directory, hf_model = llama
    prompts = random_prompts(LENGTHS)
    llm = LLM(str(directory), device="cpu", max_model_len=512)
    outputs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = reference_greedy(hf_model, prompt, MAX_TOKENS)
        assert output.outputs[0].finish_reason == "length"
        assert_greedy_equal(output.outputs[0].token_ids, ref, f"len {len(prompt)}")
    assert torch.get_default_dtype() == torch.float32
