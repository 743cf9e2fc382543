"""The paged KV cache's settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfleet_engine.config.checks import check, check_switch, is_int, is_number

KV_CACHE_DTYPES = ("auto", "fp8", "int8")


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block.
    block_size: int = 16
    # Number of KV blocks; None sizes the cache from free memory.
    num_blocks: int | None = None
    # Fraction of GPU memory the engine may use (weights + activations + KV cache).
    gpu_memory_utilization: float = 0.9
    # Reuse the KV of full blocks shared with earlier prompts.
    enable_prefix_caching: bool = True
    # KV cache element type: auto (the model's dtype) | fp8 (e4m3 values with a scale per token
    # and kv head: about twice the tokens in the same memory) | int8 (the same with integer
    # codes: as many tokens, closer to the model's dtype, no e4m3 hardware needed).
    kv_cache_dtype: str = "auto"
    # An fp8 cache's K rounded toward the queries: a file of each layer's query moment
    # (`python -m kvfleet_engine.bench.calibrate_kv`; `layers.kv_shaping`). None: to nearest.
    kv_cache_calibration: str | None = None


def is_block_size(value: object) -> bool:
    """Tokens per KV block: a power of two in [1, 256]."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and 1 <= value <= 256
        and value & (value - 1) == 0
    )


def check_cache(cache: CacheConfig) -> None:
    """Each setting's type and range, named by its EngineConfig.create keyword."""
    block_size = cache.block_size
    check(
        is_block_size(block_size),
        "block_size",
        block_size,
        "a power of two in [1, 256]",
    )
    check(
        cache.num_blocks is None or (is_int(cache.num_blocks) and cache.num_blocks >= 1),
        "kv_cache_blocks",
        cache.num_blocks,
        "an integer >= 1 or None (size from memory)",
    )
    utilization = cache.gpu_memory_utilization
    check(
        is_number(utilization) and 0.0 < utilization <= 1.0,
        "gpu_memory_utilization",
        utilization,
        "a number in (0, 1]",
    )
    check_switch("enable_prefix_caching", cache.enable_prefix_caching)
    check(
        cache.kv_cache_dtype in KV_CACHE_DTYPES,
        "kv_cache_dtype",
        cache.kv_cache_dtype,
        " | ".join(KV_CACHE_DTYPES),
    )
    check_calibration(cache.kv_cache_calibration, cache.kv_cache_dtype)


def check_calibration(path: str | None, kv_cache_dtype: str) -> None:
    """`kv_cache_calibration` with what it needs: an fp8 cache and a file that exists."""
    if path is None:
        return
    name = "kv_cache_calibration"
    check(isinstance(path, str), name, path, "a file path or None")
    check(
        kv_cache_dtype == "fp8",
        name,
        path,
        f"used with kv_cache_dtype fp8 (kv_cache_dtype is {kv_cache_dtype!r})",
    )
    check(Path(path).is_file(), name, path, "an existing file")
