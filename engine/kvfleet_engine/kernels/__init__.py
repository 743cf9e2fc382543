"""Triton kernels for the paged KV cache, each behind a wrapper that checks its inputs.

`store_kv`, `paged_decode_attention` and `prefill_attention` have the signatures of the torch
reference (`kvfleet_engine.layers.attention_torch`, ENGINE_CONTRACT.md).
"""

from kvfleet_engine.kernels.decode_attention import paged_decode_attention
from kvfleet_engine.kernels.kv_store import store_kv
from kvfleet_engine.kernels.prefill_attention import prefill_attention

__all__ = ["paged_decode_attention", "prefill_attention", "store_kv"]
