"""The metrics module renders every contract name from plain records."""

from typing import Any

from kvfleet_engine.metrics import EngineInfo, EngineMetrics, FinishedRequestStats, IterationStats
from kvfleet_engine.outputs import SchedulerStats

CONTRACT_NAMES = [
    "kvfleet_requests_running",
    "kvfleet_requests_waiting",
    "kvfleet_kv_cache_usage_ratio",
    "kvfleet_prompt_tokens_total",
    "kvfleet_generation_tokens_total",
    "kvfleet_request_success_total",
    "kvfleet_requests_rejected_total",
    "kvfleet_preemptions_total",
    "kvfleet_prefix_cache_queries_total",
    "kvfleet_prefix_cache_hits_total",
    "kvfleet_shared_prefix_steps_total",
    "kvfleet_engine_steps_total",
    "kvfleet_time_to_first_token_seconds_bucket",
    "kvfleet_inter_token_latency_seconds_bucket",
    "kvfleet_e2e_request_latency_seconds_bucket",
    "kvfleet_request_queue_time_seconds_bucket",
    "kvfleet_engine_capacity_tokens_per_second",
    "kvfleet_engine_info",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
]


def Stats(**overrides: Any) -> SchedulerStats:
    fields: dict[str, Any] = {
        "num_running": 3,
        "num_waiting": 2,
        "kv_cache_usage": 0.25,
        "num_preemptions_total": 1,
        "prefix_cache_queries_total": 160,
        "prefix_cache_hits_total": 32,
        "num_prompt_tokens_total": 500,
        "num_generation_tokens_total": 70,
        "num_blocks_total": 64,
        "num_blocks_free": 48,
        "shared_prefix_steps_total": 9,
        "prefill_steps_total": 4,
        "mixed_steps_total": 6,
        "decode_steps_total": 50,
    }
    return SchedulerStats(**{**fields, **overrides})


def sample(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not in metrics")


def test_every_contract_name_is_exported_with_values_from_the_records() -> None:
    m = EngineMetrics(EngineInfo("tiny", "0.1.0", "none", 1))
    m.set_baseline(
        Stats(
            num_prompt_tokens_total=100,
            num_generation_tokens_total=20,
            shared_prefix_steps_total=2,
            prefill_steps_total=1,
            mixed_steps_total=0,
            decode_steps_total=10,
        )
    )
    m.observe_scheduler(Stats())
    m.set_capacity(1234.5)
    m.observe_iteration(
        IterationStats([0.05], [0.01, 0.02], [FinishedRequestStats("length", 0.9, 0.003)])
    )
    m.observe_rejected("queue_full")
    text = m.render()[0].decode()
    for name in CONTRACT_NAMES:
        assert f"\n{name}{{" in text, name
    assert sample(text, 'vllm:num_requests_running{model_name="tiny"}') == 3
    assert sample(text, 'kvfleet_kv_cache_usage_ratio{model_name="tiny"}') == 0.25
    assert sample(text, 'kvfleet_shared_prefix_steps_total{model_name="tiny"}') == 7
    steps = [
        sample(text, f'kvfleet_engine_steps_total{{kind="{kind}",model_name="tiny"}}')
        for kind in ("prefill", "mixed", "decode")
    ]
    assert steps == [3, 6, 40]
    # The self-benchmark's tokens (the baseline) are left out of the totals.
    assert sample(text, 'kvfleet_prompt_tokens_total{model_name="tiny"}') == 400
    assert sample(text, 'vllm:generation_tokens_total{model_name="tiny"}') == 50
    assert sample(text, 'kvfleet_request_success_total{finish_reason="length"') == 1
    assert (
        sample(text, 'kvfleet_requests_rejected_total{model_name="tiny",reason="queue_full"}') == 1
    )
    assert sample(text, 'kvfleet_inter_token_latency_seconds_count{model_name="tiny"}') == 2
    assert sample(text, 'kvfleet_engine_capacity_tokens_per_second{model_name="tiny"}') == 1234.5
    assert 'kvfleet_engine_info{model="tiny",quantization="none",tensor_parallel_size="1"' in text
