"""SLA mode's hook in the scheduler: a lowered per-step token budget holds for every step."""

from __future__ import annotations

import pytest

from kvfleet_engine.config import SchedulerConfig
from kvfleet_engine.kv_cache import KVCacheManager
from kvfleet_engine.outputs import ModelRunnerOutput
from kvfleet_engine.request import Request
from kvfleet_engine.sampling import SamplingParams
from kvfleet_engine.scheduler import Scheduler


def test_token_budget_caps_every_step_and_decodes_keep_running() -> None:
    kv = KVCacheManager(128, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), kv, 512)
    scheduler.set_token_budget(10)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for k in range(4):
        scheduler.add(Request(f"r{k}", [1 + k] * 30, params, arrival_time=float(k)))
    per_step = []
    for _ in range(40):
        out = scheduler.schedule()
        per_step.append(out.num_batched_tokens)
        sampled = {item.request_id: 7 for item in out.requests if item.sample}
        scheduler.update(out, ModelRunnerOutput(sampled_token_ids=sampled, logprobs={}))
    assert max(per_step) == 10  # 120 prompt tokens took >= 12 steps, never more than 10 a step
    assert all(len(r.output_token_ids) > 0 for r in scheduler.requests.values())
    with pytest.raises(ValueError, match="token budget must be in"):
        scheduler.set_token_budget(257)
