"""EngineConfig: every setting checked once at the edge (LLM(...) keywords or `kvfleet serve`
flags), then split into the sub-configs each component receives. The sub-configs' dataclasses
hold the defaults; create()'s keywords and the CLI flags read them from there."""

from __future__ import annotations

import argparse
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

from kvfleet_engine.config.cache import CacheConfig, check_cache
from kvfleet_engine.config.checks import check
from kvfleet_engine.config.cli import QUANTIZATION_CHOICES, add_engine_args, engine_keywords
from kvfleet_engine.config.model import ModelConfig
from kvfleet_engine.config.parallel import ParallelConfig, check_model_split, check_parallel
from kvfleet_engine.config.runner import RunnerConfig, check_runner
from kvfleet_engine.config.scheduler import SchedulerConfig, check_scheduler
from kvfleet_engine.quant.config import METHODS as QUANTIZATION_METHODS


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    runner: RunnerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def create(
        cls,
        model: str,
        *,
        dtype: str = "auto",
        device: str = RunnerConfig.device,
        block_size: int = CacheConfig.block_size,
        kv_cache_blocks: int | None = CacheConfig.num_blocks,
        gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
        kv_cache_dtype: str = CacheConfig.kv_cache_dtype,
        kv_cache_calibration: str | None = CacheConfig.kv_cache_calibration,
        attention_backend: str = RunnerConfig.attention_backend,
        enforce_eager: bool = RunnerConfig.enforce_eager,
        shared_prefix_attention: bool = RunnerConfig.shared_prefix_attention,
        async_scheduling: bool = SchedulerConfig.async_scheduling,
        seed: int = RunnerConfig.seed,
        tensor_parallel_size: int = ParallelConfig.tensor_parallel_size,
        pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size,
        nnodes: int = ParallelConfig.nnodes,
        node_rank: int = ParallelConfig.node_rank,
        master_addr: str = ParallelConfig.master_addr,
        master_port: int = ParallelConfig.master_port,
        parallel_join_timeout_s: float = ParallelConfig.join_timeout_s,
        quantization: str | None = None,
    ) -> EngineConfig:
        """Validate the settings and read the model's config.json (the only I/O). `dtype`
        "auto": the checkpoint's; `max_model_len` None: the model's; `quantization` None: the
        checkpoint's. A bad setting raises ValueError naming its keyword."""
        check(
            isinstance(model, str | os.PathLike),
            "model",
            model,
            "the path of a model directory or a GGUF file",
        )
        parallel = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            join_timeout_s=parallel_join_timeout_s,
        )
        check_parallel(parallel)
        check(
            quantization is None or quantization in QUANTIZATION_CHOICES,
            "quantization",
            quantization,
            "auto (None: the checkpoint's) | " + " | ".join(QUANTIZATION_METHODS),
        )
        cache = CacheConfig(
            block_size=block_size,
            num_blocks=kv_cache_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_calibration=kv_cache_calibration,
        )
        check_cache(cache)
        scheduler = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            async_scheduling=async_scheduling,
        )
        check_scheduler(scheduler)
        runner = RunnerConfig(
            device=device,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            shared_prefix_attention=shared_prefix_attention,
            seed=seed,
        )
        check_runner(runner)
        model_config = ModelConfig.from_pretrained(
            os.fspath(model), dtype=dtype, max_model_len=max_model_len, quantization=quantization
        )
        check_model_split(model_config, parallel)
        return cls(model_config, cache, scheduler, runner, parallel)

    @classmethod
    def keyword_names(cls) -> frozenset[str]:
        """The keywords create() accepts (LLM(**kwargs) checks against them)."""
        return frozenset(inspect.signature(cls.create).parameters)

    @classmethod
    def keyword_defaults(cls) -> dict[str, Any]:
        """Each keyword's default (all but `model`, which has none)."""
        return {
            name: parameter.default
            for name, parameter in inspect.signature(cls.create).parameters.items()
            if parameter.default is not inspect.Parameter.empty
        }

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_engine_args(parser, cls.keyword_defaults())

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineConfig:
        return cls.create(ns.model, **engine_keywords(ns))
