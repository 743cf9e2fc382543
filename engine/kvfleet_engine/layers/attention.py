"""The attention layer over the paged KV cache: rotate this step's q/k, store its K/V, then attend
with one backend (`attention_torch`, the reference; `attention_sdpa`, the CPU one; the Triton
kernels on a GPU), all with the reference's signatures. A backend that offers `rotary_store_kv`
does the rotation and the store in one launch, and one that offers `rotary_decode_attention` a
decode step's rotation, store and attention in one. With a quantized cache (fp8 or int8) every
one of them also takes the layer's `k_scales` and `v_scales` (keywords; None for a cache in the
model's dtype), a backend with `SHARED_PREFIX` its decode functions the step's `shared_prefix`
when it has one, and one with `DECODES_APART` a mixed step's one-token sequences to its decode
function. A quantized cache stores K rotated (`kv_rotation`): the layer rotates q and k after
RoPE (the backend's `rotary_store_kv(hadamard=True)`, or torch), so decode steps take that path,
not the one-call `rotary_decode_attention`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from kvfleet_engine.layers import kv_rotation, kv_shaping
from kvfleet_engine.layers.rotary import RotaryEmbedding

BACKEND_MODULES = {
    "torch": "kvfleet_engine.layers.attention_torch",
    "sdpa": "kvfleet_engine.layers.attention_sdpa",
    "triton": "kvfleet_engine.kernels",
}
_BACKEND_FUNCTIONS = ("store_kv", "paged_decode_attention", "prefill_attention")


def load_backend(name: str) -> ModuleType:
    """The module providing store_kv, paged_decode_attention and prefill_attention (and
    optionally rotary_store_kv)."""
    if name not in BACKEND_MODULES:
        raise ValueError(
            f"attention_backend must be one of {sorted(BACKEND_MODULES)}, got {name!r}"
        )
    try:
        module = importlib.import_module(BACKEND_MODULES[name])
    except ImportError as error:
        raise ValueError(f"attention_backend {name!r} is unavailable: {error}") from error
    missing = [f for f in _BACKEND_FUNCTIONS if not hasattr(module, f)]
    if missing:
        raise ValueError(f"attention_backend {name!r} lacks {', '.join(missing)}")
    return module


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each sequence attends to."""

    # [num_tokens] int64: cache slot of each token (block_id * block_size + offset), -1 = skip.
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: each sequence's block table, padded with 0.
    block_tables: torch.Tensor
    # [num_seqs] int32: tokens in the cache per sequence after this step's are stored.
    context_lens: torch.Tensor
    # [num_seqs + 1] int32: prefix sums of the query lengths (tokens packed back to back).
    cu_query_lens: torch.Tensor
    # Every sequence has exactly one query token (pure decode step).
    is_decode: bool
    # A decode step in which many sequences start with the same cache blocks: [2 + num_seqs]
    # int32, the prefix's tokens, a holder's row, each sequence's share (`kernels.shared_prefix`);
    # None: nothing shared, or a backend without `SHARED_PREFIX`. In a step whose decodes go
    # apart, the same over its one-token sequences.
    shared_prefix: torch.Tensor | None = None
    # A step with prompt tokens whose one-token sequences the decode kernels attend (a backend
    # with `DECODES_APART`; `kernels.decode_attention`), the rest the prefill kernel.
    decodes_apart: bool = False


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # A quantized cache only: each slot's K and V scale, [num_blocks, kv_heads, block_size].
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        self.backend: ModuleType | None = None
        # The backend's fused rotary + store_kv, and rotary + store_kv + decode attention.
        self.rotary_store_kv: Callable[..., None] | None = None
        self.rotary_decode_attention: Callable[..., torch.Tensor] | None = None
        # q and k times the Hadamard matrix after RoPE (a quantized cache: `kv_rotation`).
        self.rotates = False
        # An fp8 cache's K rounded toward the queries (`kv_shaping`): their second moment,
        # factored (`kv_calibration.bind_moments`), or None.
        self.k_moment: kv_shaping.KMoment | None = None
        # While calibrating (`bench.calibrate_kv`): the running sum of the rotated queries'
        # `kv_shaping.query_moment`; None otherwise.
        self.query_moments: torch.Tensor | None = None

    def bind(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: ModuleType,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        """Attach this layer's slice of the KV cache, [num_blocks, block_size, kv_heads, dim]
        (and, for a quantized cache, its scales)."""
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend
        self.k_scales, self.v_scales = k_scales, v_scales
        self.rotary_store_kv = getattr(backend, "rotary_store_kv", None)
        self.rotary_decode_attention = getattr(backend, "rotary_decode_attention", None)
        self.rotates = kv_rotation.rotates(self.head_dim, k_scales is not None)
        if self.rotates:  # the one-call decode does not rotate by H
            self.rotary_decode_attention = None
        if self.k_moment is not None:  # the one-call decode stores K to nearest
            self.rotary_decode_attention = None

    def shape_k_by(self, moment: kv_shaping.KMoment) -> None:
        """Round this layer's fp8 K toward the queries of second moment `moment` (`kv_shaping`):
        every store takes it (`k_moment`)."""
        self.k_moment = moment
        self.rotary_decode_attention = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before rotary
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before rotary
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        positions: torch.Tensor,  # [num_tokens] int64
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        backend = self.backend
        assert backend is not None, "Attention.bind() was not called (no KV cache)"
        # This step's tokens: rotated, and their K/V stored in the cache.
        new_tokens = (positions, query, key, value, rotary.cos_sin, self.k_cache, self.v_cache)
        scales: dict[str, torch.Tensor | None] = {}
        if self.k_scales is not None:  # a quantized cache: its scales go to every backend call
            scales = {"k_scales": self.k_scales, "v_scales": self.v_scales}
        shared = {} if meta.shared_prefix is None else {"shared_prefix": meta.shared_prefix}
        if meta.is_decode and self.rotary_decode_attention is not None:
            out = self.rotary_decode_attention(
                *new_tokens,
                meta.slot_mapping,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                **scales,
                **shared,
            )
            return out.reshape(out.shape[0], -1)
        shaped = {} if self.k_moment is None else {"k_moment": self.k_moment}
        if self.rotary_store_kv is not None:  # rotates query and key in place
            rotation = {"hadamard": True} if self.rotates else {}
            self.rotary_store_kv(*new_tokens, meta.slot_mapping, **scales, **rotation, **shaped)
        else:
            query, key = rotary(positions, query, key)
            if self.rotates:
                query, key = kv_rotation.rotate(query), kv_rotation.rotate(key)
            backend.store_kv(
                key, value, self.k_cache, self.v_cache, meta.slot_mapping, **scales, **shaped
            )
        if self.query_moments is not None:
            self.query_moments += kv_shaping.query_moment(query, self.num_kv_heads)
        if meta.is_decode:
            out = backend.paged_decode_attention(
                query,
                self.k_cache,
                self.v_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                **scales,
                **shared,
            )
        else:
            apart = {"decodes_apart": True} if meta.decodes_apart else {}
            out = backend.prefill_attention(
                query,
                self.k_cache,
                self.v_cache,
                meta.block_tables,
                meta.cu_query_lens,
                meta.context_lens,
                self.scale,
                **scales,
                **apart,
            )
            if meta.decodes_apart:  # the one-token sequences' rows of `out`
                backend.paged_decode_attention(
                    query,
                    self.k_cache,
                    self.v_cache,
                    meta.block_tables,
                    meta.context_lens,
                    self.scale,
                    **scales,
                    **shared,
                    cu_query_lens=meta.cu_query_lens,
                    out=out,
                )
        return out.reshape(out.shape[0], -1)
