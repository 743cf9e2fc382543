"""The engine's greedy tokens equal transformers' on the same tiny random checkpoints (CPU,
float32), for every supported architecture, and stay equal under prefix caching, preemption,
chunked prefill and requests arriving mid-decode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import (
    ARCHITECTURES,
    assert_greedy_equal,
    random_prompts,
    reference_greedy,
    write_checkpoint,
)
from engine_checkpoints import Checkpoints

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LENGTHS = [1, 2, 16, 17, 45, 120, 300]


def check(checkpoints: Checkpoints, name: str, prompts: list[list[int]], outputs: list) -> None:
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        ref = checkpoints.reference(name, prompt, len(completion.token_ids))
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == GREEDY.max_tokens
        assert_greedy_equal(completion.token_ids, ref, f"{name} prompt of {len(prompt)}")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_batch_matches_transformers(
    name: str, checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    prompts = random_prompts(LENGTHS, seed=1)
    llm = make_llm(name)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    check(checkpoints, name, prompts, outputs)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_first_step_logits_match_transformers(
    name: str, checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    prompts = random_prompts([3, 37, 200], seed=2)
    engine: LLMEngine = make_llm(name).engine
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY)
    scheduled = engine.scheduler.schedule()
    logits = engine.model_runner.compute_logits(engine.model_runner.prepare_inputs(scheduled))
    for index, prompt in enumerate(prompts):
        expected = checkpoints.reference(name, prompt, GREEDY.max_tokens).first_logits
        scale = expected.abs().max().item()
        torch.testing.assert_close(logits[index], expected, rtol=1e-4, atol=1e-4 * scale)


def test_shared_prefixes_hit_the_cache_and_match(
    checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    prefix = random_prompts([100], seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts([1, 5, 30, 16], seed=4)]
    llm = make_llm("llama3")
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY, use_tqdm=False)
    rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert all(out.num_cached_tokens >= 96 for out in rest)  # six full 16-token blocks
    check(checkpoints, "llama3", prompts, first + rest)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits_total >= 3 * 96
    assert stats.prefix_cache_queries_total == sum(len(p) for p in prompts)


def test_shared_prefixes_within_one_batch_match(
    checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    prefix = random_prompts([64], seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 20, 40], seed=6)]
    llm = make_llm("llama3")
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [out.num_cached_tokens for out in outputs] == [0, 64, 64]
    check(checkpoints, "llama3", prompts, outputs)


def test_tiny_kv_cache_preempts_and_still_matches(
    checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    prompts = random_prompts([40, 41, 42, 43, 44, 45], seed=7)
    # 12 blocks of 16 tokens: a few requests fit (3-5 blocks each), their growth forces preemption.
    llm = make_llm("llama3", kv_cache_blocks=12, max_model_len=192, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions_total > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = checkpoints.reference("llama3", prompt, 30)
        assert_greedy_equal(output.outputs[0].token_ids, ref, f"prompt of {len(prompt)}")
    assert llm.engine.stats().num_blocks_free == 12


def test_small_token_budget_chunks_prefill_and_matches(
    checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    prompts = random_prompts([300, 7, 70], seed=8)
    llm = make_llm("llama3", max_num_batched_tokens=24, max_num_seqs=4)
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY)
    max_step_tokens, outputs = 0, {}
    while engine.has_unfinished_requests():
        scheduled = engine.scheduler.schedule()
        max_step_tokens = max(max_step_tokens, scheduled.num_batched_tokens)
        result = engine.model_runner.execute(scheduled)
        for request in engine.scheduler.update(scheduled, result):
            outputs[request.request_id] = engine._output(request)
    assert max_step_tokens == 24
    check(checkpoints, "llama3", prompts, [outputs[str(i)] for i in range(len(prompts))])


def test_requests_added_while_others_decode_match(
    checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    prompts = random_prompts([20, 33, 150, 5, 64], seed=9)
    engine: LLMEngine = make_llm("llama3", max_num_batched_tokens=64, max_num_seqs=8).engine
    finals = {}
    engine.add_request("0", prompts[0], GREEDY)
    engine.add_request("1", prompts[1], GREEDY)
    pending = list(enumerate(prompts))[2:]
    steps = 0
    while engine.has_unfinished_requests() or pending:
        if steps in (2, 4, 5) and pending:
            index, prompt = pending.pop(0)
            engine.add_request(str(index), prompt, GREEDY)
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        steps += 1
    check(checkpoints, "llama3", prompts, [finals[str(i)] for i in range(len(prompts))])


def test_sharded_checkpoint_with_index_loads(tmp_path: Path) -> None:
    hf_model = write_checkpoint("qwen2", tmp_path, seed=3, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    prompts = random_prompts([9, 33], seed=10)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=256)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = reference_greedy(hf_model, prompt, GREEDY.max_tokens)
        assert_greedy_equal(output.outputs[0].token_ids, ref, f"prompt of {len(prompt)}")
