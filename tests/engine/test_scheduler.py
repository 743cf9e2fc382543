"""The scheduler: token budget, priority, preemption order, abort, no starvation."""

from __future__ import annotations

from kvfleet_engine.config import SchedulerConfig
from kvfleet_engine.kv_cache import KVCacheManager
from kvfleet_engine.outputs import ModelRunnerOutput
from kvfleet_engine.request import Request, RequestStatus
from kvfleet_engine.sampling import SamplingParams
from kvfleet_engine.scheduler import Scheduler
from kvfleet_engine.step import SchedulerOutput


def make_scheduler(
    num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, max_model_len: int = 256
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs, budget), kv, max_model_len)


def add(
    scheduler: Scheduler,
    request_id: str,
    num_tokens: int,
    priority: int = 0,
    max_tokens: int = 100,
    arrival: float = 0.0,
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens = [hash((request_id, i)) % 1000 for i in range(num_tokens)]
    req = Request(request_id, tokens, params, priority=priority, arrival_time=arrival)
    scheduler.add(req)
    return req


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One step with a fake model that always samples token 7."""
    out = scheduler.schedule()
    sampled = {item.request_id: 7 for item in out.requests if item.sample}
    scheduler.update(out, ModelRunnerOutput(sampled_token_ids=sampled, logprobs={}))
    return out


def test_budget_is_shared_and_long_prompts_are_chunked() -> None:
    scheduler = make_scheduler(budget=16)
    add(scheduler, "long", 40)
    add(scheduler, "short", 3)
    first = step(scheduler)
    assert [(r.request_id, len(r.token_ids), r.sample) for r in first.requests] == [
        ("long", 16, False)
    ]
    second = step(scheduler)
    assert [(r.request_id, len(r.token_ids)) for r in second.requests] == [("long", 16)]
    third = step(scheduler)
    assert [(r.request_id, len(r.token_ids), r.sample) for r in third.requests] == [
        ("long", 8, True),
        ("short", 3, True),
    ]
    fourth = step(scheduler)  # both decode one token each
    assert [len(r.token_ids) for r in fourth.requests] == [1, 1]
    assert fourth.requests[0].start_position == 40


def test_lower_priority_value_runs_first_then_arrival_order() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "background", 4, priority=5, arrival=1.0)
    add(scheduler, "late-urgent", 4, priority=0, arrival=3.0)
    add(scheduler, "early-urgent", 4, priority=0, arrival=2.0)
    order = []
    while scheduler.has_unfinished_requests():
        for item in step(scheduler).requests:
            if item.request_id not in order:
                order.append(item.request_id)
            scheduler.finish([item.request_id], RequestStatus.FINISHED_STOPPED)
    assert order == ["early-urgent", "late-urgent", "background"]


def test_preemption_takes_the_lowest_priority_newest_request() -> None:
    # 7 blocks of 4 tokens; three 8-token prompts take 2 blocks each, then each of them
    # needs a third block for its first decode: only one is free.
    scheduler = make_scheduler(num_blocks=7, max_model_len=28)
    a = add(scheduler, "a", 8, priority=0, arrival=1.0)
    b = add(scheduler, "b", 8, priority=1, arrival=2.0)
    c = add(scheduler, "c", 8, priority=0, arrival=3.0)
    step(scheduler)  # prefill all three: 6 blocks, 1 free
    step(scheduler)  # each needs a third block: only 1 free -> preempt b (priority 1)
    assert b.status == RequestStatus.PREEMPTED
    assert a.status == c.status == RequestStatus.RUNNING
    assert scheduler.num_preemptions_total == 1
    assert b.num_computed_tokens == 0 and b.block_ids == []
    # Among equals, the newest goes first: with b out of the way, c is preempted before a.
    for _ in range(4):  # a and c reach 13 tokens: each needs a fourth block, one is free
        step(scheduler)
    assert c.status == RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert a.status == RequestStatus.RUNNING and a.num_preemptions == 0
    assert scheduler.num_preemptions_total == 2


def test_abort_frees_blocks_of_running_and_drops_waiting() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=1)
    running = add(scheduler, "running", 10)
    add(scheduler, "waiting", 3)
    step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 1
    scheduler.finish(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.num_free_blocks == 4
    assert not scheduler.has_unfinished_requests()
    assert step(scheduler).requests == []
    assert scheduler.stats().num_running == scheduler.stats().num_waiting == 0


def test_a_big_request_at_the_head_is_not_starved_by_small_ones() -> None:
    # The big prompt needs 12 of 16 blocks; small requests keep arriving. It must run as soon
    # as the early small ones finish, not wait behind later ones.
    scheduler = make_scheduler(num_blocks=16, budget=64, max_model_len=64)
    for i in range(3):
        add(scheduler, f"small{i}", 12, max_tokens=4, arrival=float(i))
    big = add(scheduler, "big", 44, max_tokens=2, arrival=10.0)
    for n in range(30):
        add(scheduler, f"later{n}", 12, max_tokens=4, arrival=20.0 + n)
        step(scheduler)
        if big.is_finished:
            break
    assert big.status == RequestStatus.FINISHED_LENGTH
    assert big.output_token_ids == [7, 7]
    unfinished_later = [r for r in scheduler.requests if r.startswith("later")]
    assert unfinished_later  # later requests were still queued behind it


def test_finished_ids_reach_the_runner_once() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 3, max_tokens=1)
    step(scheduler)  # prefill samples its only token and finishes
    assert step(scheduler).finished_request_ids == frozenset({"a"})
    assert step(scheduler).finished_request_ids == frozenset()


def test_stats_count_prompt_and_generated_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 5, max_tokens=3)
    for _ in range(3):
        step(scheduler)
    stats = scheduler.stats()
    assert stats.num_prompt_tokens_total == 5
    assert stats.num_generation_tokens_total == 3
    assert stats.num_blocks_free == stats.num_blocks_total == 64


def step_kinds(scheduler: Scheduler) -> tuple[int, int, int]:
    stats = scheduler.stats()
    return stats.prefill_steps_total, stats.mixed_steps_total, stats.decode_steps_total


def test_steps_are_counted_by_what_they_computed() -> None:
    scheduler = make_scheduler(budget=16)
    add(scheduler, "a", 20, max_tokens=3)
    step(scheduler)  # a's first chunk
    step(scheduler)  # a's last 4 prompt tokens: it samples, but computed prompt tokens
    assert step_kinds(scheduler) == (2, 0, 0)
    add(scheduler, "b", 8, max_tokens=2)
    step(scheduler)  # a decodes beside b's prompt
    step(scheduler)  # both decode; both finish
    assert step_kinds(scheduler) == (2, 1, 1)
    assert not scheduler.has_unfinished_requests()
    assert step(scheduler).requests == []  # a step with nothing to compute counts as nothing
    assert step_kinds(scheduler) == (2, 1, 1)


def test_a_preempted_requests_recompute_counts_as_prompt_work() -> None:
    # As in the preemption test: b is preempted at the first decode; a finishes at once, c
    # decodes on while b recomputes its 8 prompt tokens and its first output token (less the
    # first block, which the prefix cache still holds).
    scheduler = make_scheduler(num_blocks=7, max_model_len=28)
    add(scheduler, "a", 8, priority=0, arrival=1.0, max_tokens=2)
    b = add(scheduler, "b", 8, priority=1, arrival=2.0)
    add(scheduler, "c", 8, priority=0, arrival=3.0, max_tokens=4)
    step(scheduler)
    step(scheduler)
    assert b.status == RequestStatus.PREEMPTED
    assert step_kinds(scheduler) == (1, 0, 1)
    recompute = step(scheduler)
    assert sorted((r.request_id, len(r.token_ids)) for r in recompute.requests) == [
        ("b", 5),
        ("c", 1),
    ]
    assert step_kinds(scheduler) == (1, 1, 1)
