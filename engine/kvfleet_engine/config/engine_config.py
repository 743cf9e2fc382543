"""EngineConfig: every setting checked once at the edge (LLM(...) keywords or `kvfleet serve`
flags), then split into the sub-configs each component receives. The sub-configs' dataclasses
hold the defaults; create()'s keywords and the CLI flags read them from there."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, field
from typing import Any

from kvfleet_engine.config.cache import KV_CACHE_DTYPES, CacheConfig, check_calibration
from kvfleet_engine.config.checks import check
from kvfleet_engine.config.cli import QUANTIZATION_CHOICES, add_engine_args, engine_keywords
from kvfleet_engine.config.model import ModelConfig
from kvfleet_engine.config.parallel import ParallelConfig, check_model_split, check_parallel
from kvfleet_engine.config.runner import ATTENTION_BACKENDS, RunnerConfig
from kvfleet_engine.config.scheduler import SchedulerConfig
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
        checkpoint's."""
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
        check(
            isinstance(block_size, int)
            and 1 <= block_size <= 256
            and block_size & (block_size - 1) == 0,
            "block_size",
            block_size,
            "a power of two in [1, 256]",
        )
        check(
            kv_cache_blocks is None or kv_cache_blocks >= 1,
            "kv_cache_blocks",
            kv_cache_blocks,
            "an integer >= 1 or None (size from memory)",
        )
        check(
            0.0 < gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            gpu_memory_utilization,
            "in (0, 1]",
        )
        check(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, "an integer >= 1")
        check(
            max_num_batched_tokens >= max_num_seqs,
            "max_num_batched_tokens",
            max_num_batched_tokens,
            f">= max_num_seqs ({max_num_seqs})",
        )
        check(
            device == "auto" or device == "cpu" or device.startswith("cuda"),
            "device",
            device,
            "auto, cpu, cuda or cuda:N",
        )
        check(
            attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            attention_backend,
            " | ".join(ATTENTION_BACKENDS),
        )
        check(
            kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            kv_cache_dtype,
            " | ".join(KV_CACHE_DTYPES),
        )
        check_calibration(kv_cache_calibration, kv_cache_dtype)
        model_config = ModelConfig.from_pretrained(
            model, dtype=dtype, max_model_len=max_model_len, quantization=quantization
        )
        check_model_split(model_config, parallel)
        return cls(
            model=model_config,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=kv_cache_blocks,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
                kv_cache_calibration=kv_cache_calibration,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                async_scheduling=async_scheduling,
            ),
            runner=RunnerConfig(
                device=device,
                attention_backend=attention_backend,
                enforce_eager=enforce_eager,
                shared_prefix_attention=shared_prefix_attention,
                seed=seed,
            ),
            parallel=parallel,
        )

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
