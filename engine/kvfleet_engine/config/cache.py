"""The paged KV cache's settings."""

from __future__ import annotations

from dataclasses import dataclass

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
