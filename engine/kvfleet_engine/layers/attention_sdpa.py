"""Attention over the paged KV cache with torch's `scaled_dot_product_attention`: the CPU backend.

A decode step is one attention call for the whole batch: every sequence's slots are gathered into
one padded [num_seqs, context, kv_heads, head_dim] batch, the padding masked. A prompt step is one
call per sequence (its query is the last tokens of its context: causal from the bottom right).
Grouped-query heads are shared, not copied (`enable_gqa`). Same signatures and cache layout as the
reference, `attention_torch`, whose `store_kv` it uses; an fp8 cache is dequantized (to the
query's dtype) as it is gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfleet_engine.layers.attention_torch import dequantize_kv, prefill_each_sequence, store_kv

__all__ = ["paged_decode_attention", "prefill_attention", "store_kv"]


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: fp8 cache
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    block_size = k_cache.shape[1]
    lens = context_lens.tolist()
    max_len = max(lens)
    positions = torch.arange(max_len, device=query.device).expand(len(lens), max_len)
    visible = None
    if min(lens) < max_len:  # padded: a slot past a sequence may hold anything (even NaN), so
        # padding reads the sequence's first slot instead, and the mask drops it
        visible = positions < context_lens[:, None]  # [num_seqs, max_len]
        positions = positions * visible
        visible = visible[:, None, None, :]
    blocks = block_tables.long().gather(1, positions // block_size)  # [num_seqs, max_len]
    offsets = positions % block_size
    slots = blocks * block_size + offsets
    key = k_cache.flatten(0, 1)[slots]  # [num_seqs, max_len, num_kv_heads, head_dim]
    value = v_cache.flatten(0, 1)[slots]
    if k_scales is not None and v_scales is not None:  # [num_seqs, max_len, num_kv_heads] each
        key = dequantize_kv(key, k_scales[blocks, :, offsets]).to(query.dtype)
        value = dequantize_kv(value, v_scales[blocks, :, offsets]).to(query.dtype)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [num_seqs, num_q_heads, 1, head_dim]
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=visible,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], sequences back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_query_lens: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32 = cached prefix + this step's query tokens
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: fp8 cache
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    return prefill_each_sequence(
        _attend,
        query,
        (k_cache, v_cache, k_scales, v_scales),
        block_tables,
        cu_query_lens,
        context_lens,
        scale,
    )


def _attend(
    query: torch.Tensor,  # [q_len, num_q_heads, head_dim], the last q_len positions of the context
    key: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [q_len, num_q_heads, head_dim]
    q_len, context_len = query.shape[0], key.shape[0]
    key, value = key.to(query.dtype), value.to(query.dtype)  # float32 from an fp8 cache
    mask = None
    if q_len < context_len:  # query i sees the context up to its own position
        positions = torch.arange(context_len - q_len, context_len, device=query.device)
        mask = torch.arange(context_len, device=query.device) <= positions[:, None]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)
