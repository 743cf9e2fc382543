"""Sampling: parameter validation, masks, penalties, seeds, logprobs, stop conditions."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_cases import random_prompts
from engine_checkpoints import Checkpoints

from kvfleet_engine import SamplingParams
from kvfleet_engine.layers.sampler import (
    Penalties,
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_params_normalise_lists_and_children_get_shifted_seeds() -> None:
    params = SamplingParams(n=3, seed=10, stop=["a", "b"], stop_token_ids=[5])
    assert params.stop == ("a", "b") and params.stop_token_ids == (5,)
    assert [params.for_child(i).seed for i in range(3)] == [10, 11, 12]
    assert params.for_child(1).n == 1


def test_top_k_keeps_the_k_best() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, True, False]]
    assert out[0, 1] == 4.0


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    kept = torch.isfinite(apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.6])))
    assert kept.tolist() == [[True, True, False]]
    kept = torch.isfinite(apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.4])))
    assert kept.tolist() == [[True, False, False]]


def test_min_p_drops_tokens_far_below_the_best() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    assert (apply_min_p(probs, torch.tensor([0.5])) > 0).tolist() == [[True, True, False]]
    assert (apply_min_p(probs, torch.tensor([0.0])) > 0).all()


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    penalties = Penalties(
        repetition=torch.tensor([2.0]),
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
        prompt_mask=torch.tensor([[True, True, False, False]]),
        output_counts=torch.tensor([[0, 0, 2, 0]]),
    )
    out = apply_penalties(logits, penalties)
    # token 0: in prompt, positive -> /2; token 1: in prompt, negative -> *2;
    # token 2: twice in output -> /2 then -0.25*2 - 0.5; token 3: untouched.
    assert out.tolist() == [[1.0, -4.0, 0.5 - 0.5 - 0.5, 1.0]]


def _meta(rows: int, **overrides: Any) -> SamplingMetadata:
    settings: dict[str, Any] = dict(
        temperatures=torch.ones(rows),
        top_ks=torch.full((rows,), 1000),
        top_ps=torch.ones(rows),
        min_ps=torch.zeros(rows),
        all_greedy=False,
        generators={},
        penalties=None,
        max_num_logprobs=None,
    )
    settings.update(overrides)
    return SamplingMetadata(**settings)


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    sampler = Sampler()

    def sample_row0(batch: torch.Tensor) -> int:
        generator = torch.Generator().manual_seed(1234)
        meta = _meta(batch.shape[0], generators={0: generator})
        return int(sampler(batch, meta).token_ids[0])

    alone = [sample_row0(logits[:1]) for _ in range(3)]
    batched = sample_row0(logits)
    assert alone == [alone[0]] * 3 and batched == alone[0]


def test_sampling_follows_the_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[math.log(0.7), math.log(0.2), math.log(0.1)]]).repeat(4000, 1)
    tokens = Sampler()(logits, _meta(4000)).token_ids
    freqs = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freqs, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    meta = _meta(2, temperatures=torch.tensor([0.0, 1.0]), top_ks=torch.tensor([3, 1]))
    assert Sampler()(logits, meta).token_ids.tolist() == [1, 1]


def test_seeded_generation_is_reproducible(make_llm: Callable[..., Any]) -> None:
    llm = make_llm("llama3")
    prompts = random_prompts([5, 9], seed=11)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=seeded, use_tqdm=False)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=seeded, use_tqdm=False)
    other = llm.generate(
        prompt_token_ids=prompts[:1],
        sampling_params=SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert first[0].outputs[0].token_ids != other[0].outputs[0].token_ids


def test_n_completions_are_distinct_and_indexed(make_llm: Callable[..., Any]) -> None:
    llm = make_llm("llama3")
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)
    (output,) = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    assert output.finished and all(c.finish_reason == "length" for c in output.outputs)


def test_logprobs_of_sampled_and_top_tokens(
    checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    prompt = random_prompts([20], seed=12)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    (output,) = make_llm("llama3").generate(
        prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False
    )
    completion = output.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in entry and len(entry) == 3  # greedy: the sampled token is the top one
        assert entry[token_id] == max(entry.values()) and all(v <= 0 for v in entry.values())
    expected_total = sum(
        e[t] for t, e in zip(completion.token_ids, completion.logprobs, strict=True)
    )
    assert completion.cumulative_logprob == pytest.approx(expected_total)
    reference = checkpoints.reference("llama3", prompt, 4).first_logits.log_softmax(-1)
    for token_id, value in completion.logprobs[0].items():
        assert value == pytest.approx(reference[token_id].item(), abs=1e-4)


def test_logprobs_zero_gives_only_the_sampled_token(make_llm: Callable[..., Any]) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=3, logprobs=0, ignore_eos=True)
    (output,) = make_llm("llama3").generate(
        prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False
    )
    completion = output.outputs[0]
    assert completion.logprobs is not None
    assert [list(e) for e in completion.logprobs] == [[t] for t in completion.token_ids]


def test_no_logprobs_unless_asked(make_llm: Callable[..., Any]) -> None:
    (output,) = make_llm("llama3").generate(
        prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None


def test_stop_token_ids_and_max_tokens(make_llm: Callable[..., Any]) -> None:
    llm = make_llm("llama3")
    prompt = random_prompts([30], seed=13)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (free,) = llm.generate(prompt_token_ids=prompt, sampling_params=greedy, use_tqdm=False)
    tokens = free.outputs[0].token_ids
    stop_id = tokens[4]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]
    )
    (stopped,) = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.token_ids == tokens[: tokens.index(stop_id) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)
    assert free.outputs[0].finish_reason == "length" and free.outputs[0].stop_reason is None


def test_eos_ends_generation_unless_ignored(make_llm: Callable[..., Any]) -> None:
    llm = make_llm("llama3")
    prompt = random_prompts([30], seed=13)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate(prompt_token_ids=prompt, sampling_params=greedy, use_tqdm=False)[0]
    tokens_list = tokens.outputs[0].token_ids
    # Pretend the 4th generated token is the model's end-of-sequence token.
    llm.engine.model_config = _with_eos(llm.engine.model_config, tokens_list[3])
    params = SamplingParams(temperature=0.0, max_tokens=12)
    (out,) = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    assert out.outputs[0].token_ids == tokens_list[: tokens_list.index(tokens_list[3]) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None


def _with_eos(model_config: Any, token_id: int) -> Any:
    import dataclasses

    return dataclasses.replace(model_config, eos_token_ids=frozenset({token_id}))


def test_stop_string_cuts_the_text(make_llm: Callable[..., Any]) -> None:
    llm = make_llm("llama3")
    prompt = random_prompts([25], seed=14)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (free,) = llm.generate(prompt_token_ids=prompt, sampling_params=greedy, use_tqdm=False)
    text = free.outputs[0].text
    stop = next(ch for ch in text[1:] if ch != "\ufffd")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    (out,) = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(completion.token_ids) < 16


def test_greedy_takes_the_argmax_computed_with_the_logits_unless_penalties_change_it() -> None:
    """A decode graph hands the sampler each row's argmax; penalties move the maximum, so with
    penalties the sampler takes the argmax of the penalised logits instead."""
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    argmax = logits.argmax(dim=-1)
    greedy = _meta(1, temperatures=torch.zeros(1), all_greedy=True)
    assert Sampler()(logits, greedy, argmax).token_ids.tolist() == [0]
    penalties = Penalties(
        repetition=torch.tensor([4.0]),
        presence=torch.tensor([0.0]),
        frequency=torch.tensor([0.0]),
        prompt_mask=torch.tensor([[True, False, False]]),  # token 0: 3.0 / 4 = 0.75
        output_counts=torch.zeros(1, 3, dtype=torch.int32),
    )
    penalised = _meta(1, temperatures=torch.zeros(1), all_greedy=True, penalties=penalties)
    assert Sampler()(logits, penalised, argmax).token_ids.tolist() == [1]


def test_bf16_logits_sample_as_their_float32_cast() -> None:
    """A decode graph hands over logits in the model's dtype: greedy rows take the same tokens as
    from the float32 cast (ties to the first index), and logprobs come back in float32, equal
    to those of the cast."""
    torch.manual_seed(0)
    logits = torch.randn(8, 300).to(torch.bfloat16)
    logits[3, 7] = logits[3, 200] = 50.0  # a tie: the first index wins, as in float32
    wide = logits.float()
    greedy = _meta(8, temperatures=torch.zeros(8), all_greedy=True)
    tokens = Sampler()(logits, greedy).token_ids
    assert tokens.tolist() == wide.argmax(dim=-1).tolist() and tokens[3] == 7
    asked = _meta(8, temperatures=torch.zeros(8), all_greedy=True, max_num_logprobs=2)
    out = Sampler()(logits, asked, tokens)
    assert out.sampled_logprobs is not None and out.sampled_logprobs.dtype == torch.float32
    expected = wide.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
    assert torch.equal(out.sampled_logprobs, expected)
