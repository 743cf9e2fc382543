"""Triton kernels for the paged KV cache, each behind a wrapper that checks its inputs.

`store_kv`, `paged_decode_attention` and `prefill_attention` have the signatures of the torch
reference (`kvfleet_engine.layers.attention_torch`, whose docstring gives the cache layout);
`rotary_store_kv` is the optional fused op the attention layer uses in place of rotary +
`store_kv` (one launch, not two), and `rotary_decode_attention` the one a decode step uses in
place of all three.

`QUANTIZED_V_TOKEN_MAJOR`: the cache allocator lays a quantized cache's V out token major for this
backend (`checks.token_major`; `kv_fp8` says why). The kernels read and write either layout.
`SHARED_PREFIX`: the decode functions take a `shared_prefix`, the prefix many of the batch's
sequences share (`shared_prefix` says how it is described).
`DECODES_APART`: in a step with prompt tokens, `prefill_attention(decodes_apart=True)` leaves the
one-token sequences to `paged_decode_attention(cu_query_lens=..., out=...)` (`decode_attention`).
"""

from kvfleet_engine.kernels.decode_attention import paged_decode_attention, rotary_decode_attention
from kvfleet_engine.kernels.fused import rotary_store_kv
from kvfleet_engine.kernels.kv_store import store_kv
from kvfleet_engine.kernels.prefill_attention import prefill_attention

QUANTIZED_V_TOKEN_MAJOR = True
SHARED_PREFIX = True
DECODES_APART = True

__all__ = [
    "DECODES_APART",
    "QUANTIZED_V_TOKEN_MAJOR",
    "SHARED_PREFIX",
    "paged_decode_attention",
    "prefill_attention",
    "rotary_decode_attention",
    "rotary_store_kv",
    "store_kv",
]
