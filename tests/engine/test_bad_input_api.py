"""Bad input to SamplingParams and LLM.generate: a ValueError or TypeError naming the argument,
and the LLM keeps working afterwards; values too small for float32 sampling are handled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from engine_cases import random_prompts

from kvfleet_engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts([5, 7], seed=3)


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any]) -> LLM:
    return make_llm("llama3", max_model_len=64)


def _tokens(llm: LLM, params: Any = GREEDY, **kwargs: Any) -> list[list[int]]:
    kwargs.setdefault("prompt_token_ids", PROMPTS)
    outputs = llm.generate(sampling_params=params, use_tqdm=False, **kwargs)
    return [output.outputs[0].token_ids for output in outputs]


def _assert_still_works(llm: LLM) -> None:
    """The LLM gives the same greedy tokens as a fresh call would (no request left behind)."""
    assert _tokens(llm) == _tokens(llm)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64 - 1, "n": 2}, "seed"),  # completion 1 would take seed 2**64
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"top_k": 2**70}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": 11.0}, "repetition_penalty"),
    ],
)
def test_params_refuse_what_the_server_refuses(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_the_largest_seeds_still_generate(llm: LLM) -> None:
    params = SamplingParams(n=2, seed=2**64 - 2, max_tokens=3)
    outputs = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, use_tqdm=False)
    assert [len(c.token_ids) for c in outputs[0].outputs] == [3, 3]


def test_a_failed_generate_aborts_its_requests(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _tokens(llm)
    runner = llm.engine.model_runner
    launch = runner.launch
    calls = 0

    def failing_launch(scheduled: Any) -> Any:  # the device fails on the third step
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device error")
        return launch(scheduled)

    monkeypatch.setattr(runner, "launch", failing_launch)
    with pytest.raises(RuntimeError, match="device error"):
        _tokens(llm)
    assert not llm.engine.has_unfinished_requests()
    assert _tokens(llm) == expected


@pytest.mark.parametrize(
    ("priority", "error", "message"),
    [
        (["high", 0], TypeError, r"priority\[0\] must be int, got 'high'"),
        ([0, 1.5], TypeError, r"priority\[1\] must be int, got 1.5"),
        ([None, 0], TypeError, r"priority\[0\] must be int, got None"),
        ([True, 0], TypeError, r"priority\[0\] must be int, got True"),
        ([0], ValueError, "priority has 1 entries for 2 prompts"),
        (5, TypeError, "priority must be a list of ints"),
    ],
)
def test_priority_is_one_int_per_prompt(
    llm: LLM, priority: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        _tokens(llm, priority=priority)
    _assert_still_works(llm)


def test_the_engine_refuses_a_priority_that_is_not_an_int(llm: LLM) -> None:
    with pytest.raises(TypeError, match="priority must be int, got 'high'"):
        llm.engine.add_request("x", [1, 2], GREEDY, priority="high")  # type: ignore[arg-type]
    _assert_still_works(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompts": ["a"], "sampling_params": {"max_tokens": 2}}, "^sampling_params must be"),
        ({"prompts": ["a"], "sampling_params": [GREEDY, None]}, "^sampling_params must be"),
        ({"prompts": 5}, "^prompts must be a string or a list of strings, got int 5"),
        ({"prompts": [5]}, r"^prompts must be a string or a list of strings, got \[5\]"),
        ({"prompt_token_ids": [1, 2, 3]}, "^prompt_token_ids must be a list of token-id lists"),
        ({"prompt_token_ids": 7}, "^prompt_token_ids must be a list of token-id lists"),
        ({"prompt_token_ids": [[1.0, 2]]}, r"^prompt_token_ids must be int, got 1.0 \(float\)"),
        ({"prompt_token_ids": [[True, 2]]}, r"^prompt_token_ids must be int, got True \(bool\)"),
        ({"prompt_token_ids": [np.array([1.0])]}, "^prompt_token_ids must be int"),
    ],
)
def test_generate_names_the_argument_of_the_wrong_type(
    llm: LLM, kwargs: dict[str, Any], message: str
) -> None:
    kwargs.setdefault("sampling_params", GREEDY)
    with pytest.raises(TypeError, match=message):
        llm.generate(use_tqdm=False, **kwargs)
    _assert_still_works(llm)


@pytest.mark.parametrize("use_tqdm", ["no", 0, None])
def test_use_tqdm_is_a_bool(llm: LLM, use_tqdm: Any) -> None:
    """ "no" had shown the progress bar, 0 and None had hidden it."""
    with pytest.raises(TypeError, match=f"^use_tqdm must be True or False, got {use_tqdm!r}$"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=use_tqdm)
    _assert_still_works(llm)


def test_numpy_token_ids_are_token_ids(llm: LLM) -> None:
    as_numpy = [np.array(prompt, dtype=np.int64) for prompt in PROMPTS]
    assert _tokens(llm, prompt_token_ids=as_numpy) == _tokens(llm)
    assert _tokens(llm, prompt_token_ids=np.array([PROMPTS[0]])) == _tokens(llm)[:1]


def test_stop_token_ids_outside_the_vocabulary(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"stop_token_ids contains 10{30}, outside the vocab"):
        _tokens(llm, SamplingParams(stop_token_ids=[10**30]))
    _assert_still_works(llm)


def test_a_temperature_near_zero_is_greedy(llm: LLM) -> None:
    tiny = SamplingParams(temperature=1e-39, max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    # Next to a sampled row, so the batch takes the sampling path too.
    assert _tokens(llm, [tiny, sampled])[0] == _tokens(llm)[0]
    assert _tokens(llm, tiny) == _tokens(llm)
    assert tiny.greedy and tiny.temperature == 0.0


def test_a_tiny_top_p_keeps_the_most_likely_token(llm: LLM) -> None:
    params = SamplingParams(top_p=1e-46, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    assert _tokens(llm, params) == _tokens(llm)


def test_a_tiny_repetition_penalty_acts_as_its_floor(llm: LLM) -> None:
    def tokens(penalty: float) -> list[list[int]]:
        params = SamplingParams(
            repetition_penalty=penalty, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True
        )
        return _tokens(llm, params)

    assert tokens(1e-40) == tokens(1e-5)
