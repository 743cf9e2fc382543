"""The engine's /metrics text, as kvfleet_engine.metrics renders it, is what the router reads:
queue, running, KV usage, and vllm:cache_config_info (block size, number of blocks)."""

from __future__ import annotations

from kvfleet_engine.metrics import EngineInfo, EngineMetrics
from kvfleet_engine.outputs import SchedulerStats
from kvfleet_router.load import parse_load
from kvfleet_router.prefix_index import capacity_blocks


def test_the_router_reads_the_engines_metrics() -> None:
    metrics = EngineMetrics(EngineInfo("tiny", "0.1.0", "none", 1))
    metrics.observe_scheduler(SchedulerStats(5, 2, 0.375, 0, 0, 0, 0, 0, 4096, 2560))
    before = parse_load(metrics.render()[0].decode())
    assert before.num_gpu_blocks is None  # not known until the core reported its cache
    metrics.set_cache_config(block_size=16, num_gpu_blocks=4096)
    text = metrics.render()[0].decode()
    info = 'vllm:cache_config_info{block_size="16",model_name="tiny",num_gpu_blocks="4096"} 1.0'
    assert info in text
    sample = parse_load(text)
    assert (sample.waiting, sample.running, sample.kv_usage) == (2.0, 5.0, 0.375)
    assert (sample.block_size, sample.num_gpu_blocks) == (16, 4096)
    assert sample.model_names == {"tiny"}
    # 4096 blocks x 16 tokens x ~4 characters / 64 characters per router block
    assert capacity_blocks(sample.num_gpu_blocks, sample.block_size, 64) == 4096
