"""LLMEngine (the engine core plus text, in one process): step outputs, abort, stats, timestamps,
priorities; and the step records the engine core sends to the API process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_cases import random_prompts

from kvfleet_engine import SamplingParams
from kvfleet_engine.engine import LLMEngine

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_step_streams_cumulative_outputs_and_abort_frees_blocks(
    make_llm: Callable[..., Any],
) -> None:
    engine: LLMEngine = make_llm("llama3", kv_cache_blocks=64).engine
    short, long_ = random_prompts([5, 40], seed=41)
    engine.add_request("short", short, PARAMS, arrival_time=100.0)
    engine.add_request("long", long_, PARAMS)
    first = {o.request_id: o for o in engine.step()}
    assert set(first) == {"short", "long"}  # both prefilled and sampled a token
    assert [len(o.outputs[0].token_ids) for o in first.values()] == [1, 1]
    assert engine.stats().num_running == 2 and engine.stats().num_blocks_free == 64 - 1 - 3
    second = {o.request_id: o for o in engine.step()}
    assert second["long"].outputs[0].token_ids[:1] == first["long"].outputs[0].token_ids
    assert len(second["long"].outputs[0].token_ids) == 2 and not second["long"].finished

    engine.abort_request(["long"])
    assert engine.stats().num_running == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"short"}
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    metrics = final.metrics
    assert metrics.arrival_time == 100.0
    assert metrics.first_scheduled_time is not None and metrics.first_token_time is not None
    assert metrics.first_scheduled_time <= metrics.first_token_time <= metrics.last_token_time
    assert metrics.last_token_time <= metrics.finished_time
    stats = engine.stats()
    assert stats.num_blocks_free == 64 and stats.kv_cache_usage == 0.0
    assert stats.num_prompt_tokens_total == 45
    assert stats.num_generation_tokens_total == 6 + 2


def test_priority_decides_who_runs_first(make_llm: Callable[..., Any]) -> None:
    engine: LLMEngine = make_llm("llama3", max_num_seqs=1, max_num_batched_tokens=64).engine
    prompts = random_prompts([4, 4, 4], seed=42)
    engine.add_request("batch", prompts[0], PARAMS, priority=10)
    engine.add_request("interactive", prompts[1], PARAMS, priority=-1)
    engine.add_request("normal", prompts[2], PARAMS)
    finished_order = []
    while engine.has_unfinished_requests():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order == ["interactive", "normal", "batch"]


def test_generate_gives_the_text_and_stops_that_streaming_gives(
    make_llm: Callable[..., Any],
) -> None:
    """LLM.generate decodes text once at the end (stop strings still token by token); what it
    returns equals the last output of the engine streaming the same requests."""
    llm = make_llm("llama3", kv_cache_blocks=64)
    prompts = random_prompts([3, 20, 33], seed=7)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    streamed_free = _stream(llm.engine, prompts, plain)
    text = streamed_free[1].outputs[0].text
    stop = text[3:5]  # found in the middle of the second request's text
    assert len(stop) == 2
    with_stop = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    for params, streamed in ((plain, streamed_free), (with_stop, None)):
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        streamed = streamed or _stream(llm.engine, prompts, params)
        for got, want in zip(generated, streamed, strict=True):
            assert got.outputs[0].text == want.outputs[0].text
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
    assert generated[1].outputs[0].text == text[: text.index(stop)]
    assert generated[1].outputs[0].finish_reason == "stop"
    assert llm.engine.stream_outputs  # generate() leaves the engine streaming


def _stream(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}-{len(params.stop)}", prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return [finals[f"s{i}-{len(params.stop)}"] for i in range(len(prompts))]


def test_step_records_carry_only_each_steps_new_tokens(make_llm: Callable[..., Any]) -> None:
    """What crosses to the API process per step: the new token ids, once, and how it ended."""
    from kvfleet_engine.core.records import StepOutputs, encoder, from_core_decoder

    engine: LLMEngine = make_llm("llama3", kv_cache_blocks=64).engine
    short, long_ = random_prompts([5, 40], seed=43)
    engine.add_request("short", short, PARAMS)
    engine.add_request("long", long_, SamplingParams(temperature=0.0, max_tokens=3, logprobs=1))
    records = []
    while engine.has_unfinished_requests():
        wire = encoder().encode(engine.step_outputs())
        records.append(from_core_decoder().decode(wire))
    assert all(isinstance(r, StepOutputs) for r in records)
    tokens: dict[str, list[int]] = {"short": [], "long": []}
    for record in records:
        assert all(len(ids) == 1 for ids in record.new_token_ids)  # one new token per step
        for request_id, ids in zip(record.request_ids, record.new_token_ids, strict=True):
            tokens[request_id] += ids
    assert [len(tokens["short"]), len(tokens["long"])] == [6, 3]
    assert records[0].started.keys() == {"short", "long"}
    assert {rid for r in records for rid in r.finished} == {"short", "long"}
    finished = {rid: f for r in records for rid, f in r.finished.items()}
    assert finished["short"].finish_reason == "length"
    logprobs = [lp for r in records for lp in r.new_logprobs.get("long", [])]
    assert len(logprobs) == 3 and all(
        t in lp for t, lp in zip(tokens["long"], logprobs, strict=True)
    )
    assert records[-1].stats.num_blocks_free == 64
