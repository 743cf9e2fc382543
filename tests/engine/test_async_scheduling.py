"""Async scheduling (step n+1 launched before step n's tokens reach the host) gives exactly the
tokens, text, logprobs and finish reasons of synchronous steps, through preemption, prefix-cache
hits on generated tokens, stops, aborts, penalties and seeded sampling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_cases import assert_greedy_equal, random_prompts
from engine_checkpoints import Checkpoints

from kvfleet_engine import SamplingParams
from kvfleet_engine.config import SchedulerConfig
from kvfleet_engine.engine import LLMEngine
from kvfleet_engine.kv_cache import KVCacheManager
from kvfleet_engine.outputs import ModelRunnerOutput
from kvfleet_engine.request import Request, RequestStatus
from kvfleet_engine.scheduler import Scheduler
from kvfleet_engine.step import PENDING_TOKEN


def generate_both(
    make_llm: Callable[..., Any], prompts: list[list[int]], params: Any, **kwargs: Any
) -> tuple[list[Any], list[Any], Any]:
    """(async outputs, sync outputs, the async LLM)."""
    outputs, llms = [], []
    for async_scheduling in (True, False):
        llm = make_llm("llama3", async_scheduling=async_scheduling, **kwargs)
        outputs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
        llms.append(llm)
    return outputs[0], outputs[1], llms[0]


def summary(outputs: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
        )
        for o in outputs
    ]


def test_preemption_with_a_token_in_flight_still_matches_transformers(
    checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    prompts = random_prompts([40, 41, 42, 43, 44, 45], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    async_out, sync_out, llm = generate_both(
        make_llm,
        prompts,
        params,
        kv_cache_blocks=12,
        max_model_len=192,
        enable_prefix_caching=False,
    )
    assert llm.engine.stats().num_preemptions_total > 0
    for prompt, output in zip(prompts, async_out, strict=True):
        ref = checkpoints.reference("llama3", prompt, 30)
        assert_greedy_equal(output.outputs[0].token_ids, ref, f"prompt of {len(prompt)}")
    assert summary(async_out) == summary(sync_out)
    assert llm.engine.stats().num_blocks_free == 12


def test_blocks_filled_by_generated_tokens_are_cached_and_reused(
    checkpoints: Checkpoints, make_llm: Callable[..., Any]
) -> None:
    llm = make_llm("llama3")
    prompt = random_prompts([30], seed=21)[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    # Blocks 1 and 2 (tokens 16..47) were completed by pending tokens during decode.
    follow_up = prompt + first.outputs[0].token_ids[:20]
    second = llm.generate(prompt_token_ids=[follow_up], sampling_params=params)[0]
    assert second.num_cached_tokens == 48
    ref = checkpoints.reference("llama3", follow_up, 24)
    assert_greedy_equal(second.outputs[0].token_ids, ref, "follow-up")


def test_stops_at_different_steps_give_the_sync_outputs_and_free_every_block(
    make_llm: Callable[..., Any],
) -> None:
    prompts = random_prompts([3, 9, 27, 50, 81], seed=22)
    sync_llm = make_llm("llama3", async_scheduling=False)
    probe = sync_llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=12)
    )
    # Stop on a token each request generates mid-way, so requests end at different steps.
    stop_ids = sorted({o.outputs[0].token_ids[4] for o in probe})
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stop_ids)
    async_out, sync_out, llm = generate_both(make_llm, prompts, params)
    assert summary(async_out) == summary(sync_out)
    assert any(o.outputs[0].finish_reason == "stop" for o in async_out)
    assert llm.engine.stats().num_blocks_free == llm.engine.kv_cache.num_blocks
    assert llm.engine.in_flight is None


def test_penalties_logprobs_and_seeds_match_sync(make_llm: Callable[..., Any]) -> None:
    prompts = random_prompts([5, 33, 70], seed=23)
    for params in (
        SamplingParams(
            temperature=0.0, max_tokens=10, repetition_penalty=1.5, frequency_penalty=0.5
        ),
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234),
    ):
        async_out, sync_out, _ = generate_both(make_llm, prompts, params)
        assert summary(async_out) == summary(sync_out), params
        assert [o.outputs[0].logprobs for o in async_out] == [
            o.outputs[0].logprobs for o in sync_out
        ]


def test_abort_while_the_next_step_is_in_flight(make_llm: Callable[..., Any]) -> None:
    engine: LLMEngine = make_llm("llama3", kv_cache_blocks=64).engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    short, long_ = random_prompts([5, 40], seed=24)
    engine.add_request("short", short, params)
    engine.add_request("long", long_, params)
    first = {o.request_id: o for o in engine.step()}
    assert set(first) == {"short", "long"}  # the first call returns the first step's tokens
    assert engine.in_flight is not None  # ... with the second step already launched
    engine.abort_request("long")
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == "short"
            finals[output.request_id] = output
    assert len(finals["short"].outputs[0].token_ids) == 6
    engine.step()  # collects the step still in flight
    assert engine.stats().num_blocks_free == 64


def test_a_request_after_an_abort_emptied_the_engine_gets_its_token_in_one_step(
    make_llm: Callable[..., Any],
) -> None:
    engine: LLMEngine = make_llm("llama3", kv_cache_blocks=64).engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first, second = random_prompts([5, 9], seed=25)
    engine.add_request("gone", first, params)
    engine.step()
    assert engine.in_flight is not None
    engine.abort_request("gone")  # the only request: its step in flight is dropped with it
    assert engine.in_flight is None
    assert engine.stats().num_blocks_free == 64
    engine.add_request("next", second, params)
    assert [o.request_id for o in engine.step()] == ["next"]


# ---- the scheduler alone ------------------------------------------------------------------


def make_scheduler(num_blocks: int = 64, max_model_len: int = 256) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(8, 64), kv, max_model_len)


def add(
    scheduler: Scheduler,
    request_id: str,
    num_tokens: int,
    max_tokens: int = 100,
    first_token: int = 1,
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id, list(range(first_token, first_token + num_tokens)), params)
    scheduler.add(request)
    return request


def sampled(out: Any, token: int) -> ModelRunnerOutput:
    return ModelRunnerOutput({item.request_id: token for item in out.requests if item.sample}, {})


def test_the_next_step_takes_the_pending_token_and_update_fills_it_in() -> None:
    scheduler = make_scheduler()
    request = add(scheduler, "a", 6, max_tokens=3)
    first = scheduler.schedule()
    second = scheduler.schedule()  # before the first step's token is known
    (item,) = second.requests
    assert (item.token_ids, item.start_position, item.sample) == ([PENDING_TOKEN], 6, True)
    assert request.num_pending_tokens == 2
    scheduler.update(first, sampled(first, 11))
    third = scheduler.schedule()
    assert third.requests[0].token_ids == [PENDING_TOKEN]  # token 2, still on the device
    # Three tokens are now scheduled for max_tokens=3: no fourth step.
    scheduler.update(second, sampled(second, 12))
    assert scheduler.schedule().requests == []
    scheduler.update(third, sampled(third, 13))
    assert request.output_token_ids == [11, 12, 13]
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_a_preempted_request_waits_for_its_token_in_flight() -> None:
    scheduler = make_scheduler(num_blocks=4)  # 4 blocks of 4 tokens
    a, b = add(scheduler, "a", 7), add(scheduler, "b", 7, first_token=101)
    step1 = scheduler.schedule()  # both prefill (2 blocks each) and sample
    step2 = scheduler.schedule()  # both decode their pending token (still 2 blocks each)
    scheduler.update(step1, sampled(step1, 21))
    step3 = scheduler.schedule()  # "a" needs a third block: "b" (newest) is preempted ...
    assert [item.request_id for item in step3.requests] == ["a"]
    assert (b.status, b.num_pending_tokens) == (RequestStatus.PREEMPTED, 1)  # ... token in flight
    scheduler.finish(["a"], RequestStatus.FINISHED_ABORTED)  # room for "b" again
    assert scheduler.schedule().requests == []  # but its step-2 token is not known yet
    scheduler.update(step2, sampled(step2, 22))
    assert (b.output_token_ids, b.num_pending_tokens) == ([21, 22], 0)
    (resumed,) = scheduler.schedule().requests
    # Recomputed from known tokens only (its first block is a prefix-cache hit).
    assert (resumed.start_position, resumed.token_ids) == (4, [105, 106, 107, 21, 22])
    assert resumed.sample
    assert a.is_finished
