"""Pipeline parallelism on the CPU (gloo, float32): PP 2 and TP 2 x PP 2 give TP 1's greedy
tokens (tied embeddings on the last stage, q/k/v bias, q/k norms, a single KV head), through
prefix hits, preemption, chunked prefill and async scheduling on or off; two micro-batches
really are in flight at once; seeded sampling with penalties on the last stage gives TP 1's
tokens; the layer split and the bad sizes; a dead last stage fails the call with its reason.
Each world is spawned once per test."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from parallel_cases import (
    SETTINGS,
    assert_same_greedy,
    generate_twice,
    parallel_prompts,
)

from kvfleet_engine import SamplingParams
from kvfleet_engine.config import SchedulerConfig
from kvfleet_engine.kv_cache import KVCacheManager
from kvfleet_engine.model_runner import RankFailed
from kvfleet_engine.outputs import ModelRunnerOutput
from kvfleet_engine.parallel.pipeline import stage_layers
from kvfleet_engine.request import Request
from kvfleet_engine.scheduler import Scheduler


def _check_equal(
    world: Callable[..., Any], make_llm: Callable[..., Any], name: str, tp: int, pp: int, **kw: Any
) -> Any:
    reference = generate_twice(make_llm(name, **SETTINGS, **kw))
    llm = world(name, tp, pp, **kw)
    outputs = generate_twice(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0, "the test meant to preempt"
    assert stats.prefix_cache_hits_total > 0, "the test meant to hit the prefix cache"
    assert_same_greedy(outputs, reference, f"{name} tp{tp} pp{pp}")
    # 3 prompts on 2 stages: a micro-batch of 2 requests and one of 1 were in flight together.
    assert llm.engine.max_micro_batches_in_flight == 2
    return llm


def test_pp2_tied_embeddings_and_seeded_sampling_on_the_last_stage(
    world: Any, make_llm: Any
) -> None:
    llm = _check_equal(world, make_llm, "qwen2", 1, 2)
    # The last stage samples: seeds, penalties and logprobs travel to it, tokens come back.
    params = SamplingParams(
        temperature=0.9, seed=7, max_tokens=8, ignore_eos=True, repetition_penalty=1.3, logprobs=1
    )
    prompts = parallel_prompts()[:2]
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    reference = make_llm("qwen2", **SETTINGS)
    want = reference.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for out, ref in zip(got, want, strict=True):
        ours, theirs = out.outputs[0].logprobs, ref.outputs[0].logprobs
        assert [sorted(step) for step in ours] == [sorted(step) for step in theirs]


@pytest.mark.slow
def test_tp2_pp2(world: Any, make_llm: Any) -> None:
    _check_equal(world, make_llm, "llama3", 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "tp", "pp", "async_scheduling"),
    [
        ("llama3", 1, 2, False),
        ("llama2-tied", 1, 2, True),
        ("mistral", 1, 2, True),
        ("qwen3", 1, 2, True),
        ("qwen2", 2, 2, False),
        ("mistral", 2, 2, True),
        ("qwen3", 2, 2, True),
    ],
)
def test_every_architecture(
    world: Any, make_llm: Any, name: str, tp: int, pp: int, async_scheduling: bool
) -> None:
    _check_equal(world, make_llm, name, tp, pp, async_scheduling=async_scheduling)


def test_layers_split_evenly_the_first_stages_taking_the_rest() -> None:
    stages = [stage_layers(5, 3, s) for s in range(3)]
    assert [(s.start, s.end) for s in stages] == [(0, 2), (2, 4), (4, 5)]
    assert [(s.is_first, s.is_last) for s in stages] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert [(s.start, s.end) for s in (stage_layers(2, 2, r) for r in range(2))] == [(0, 1), (1, 2)]


def test_a_pipeline_longer_than_the_model_is_refused(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=3 is larger than the model's 2 layers"
    ):
        make_llm("llama3", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1, got 0"):
        make_llm("llama3", pipeline_parallel_size=0)


def _request(index: int, prompt_len: int) -> Request:
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        eos_token_ids=frozenset(),
        priority=0,
        arrival_time=float(index),
    )


def test_micro_batches_hold_disjoint_requests_until_their_tokens_come_back() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(8, 64), kv, 64, num_micro_batches=2)
    for index in range(4):
        scheduler.add(_request(index, 3))
    first, second = scheduler.schedule(), scheduler.schedule()
    ids = [[item.request_id for item in step.requests] for step in (first, second)]
    assert ids == [["r0", "r1"], ["r2", "r3"]]
    assert not any(item.token_ids.count(-1) for step in (first, second) for item in step.requests)
    assert scheduler.schedule().requests == []  # every request waits for its token
    scheduler.update(first, ModelRunnerOutput({"r0": 7, "r1": 8}, {}))
    third = scheduler.schedule()
    assert [(item.request_id, item.token_ids) for item in third.requests] == [
        ("r0", [7]),
        ("r1", [8]),
    ]


@pytest.mark.slow
def test_a_dead_last_stage_fails_the_call(world: Any) -> None:
    llm = world("llama3", 1, 2, max_model_len=512, kv_cache_blocks=64, max_num_batched_tokens=64)
    (pid,) = llm.engine.model_runner.workers.pids.values()
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL)).start()  # while it generates
    began = time.monotonic()
    with pytest.raises(RankFailed, match=rf"rank 1 \(pid {pid}\) exited with code -9"):
        while time.monotonic() - began < 30:
            llm.generate(
                prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=params, use_tqdm=False
            )
    assert time.monotonic() - began < 30
