"""Attention over the paged KV cache with torch's `scaled_dot_product_attention`: the CPU backend.

A decode step is one attention call for the whole batch: every sequence's slots are gathered into
one padded [num_seqs, context, kv_heads, head_dim] batch, the padding masked. A prompt step is one
call per sequence (its query is the last tokens of its context: causal from the bottom right).
Grouped-query heads are shared, not copied (`enable_gqa`). Same signatures and cache layout as the
reference, `attention_torch`, whose `store_kv` it uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfleet_engine.layers.attention_torch import gather_kv, store_kv

__all__ = ["paged_decode_attention", "prefill_attention", "store_kv"]


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    scale: float,
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
    slots = blocks * block_size + positions % block_size
    key = k_cache.flatten(0, 1)[slots]  # [num_seqs, max_len, num_kv_heads, head_dim]
    value = v_cache.flatten(0, 1)[slots]
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
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    out = torch.empty_like(query)
    starts = cu_query_lens.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        key = gather_kv(k_cache, block_tables[seq], context_len).transpose(0, 1)[None]
        value = gather_kv(v_cache, block_tables[seq], context_len).transpose(0, 1)[None]
        q = query[start:end].transpose(0, 1)[None]  # [1, num_q_heads, q_len, head_dim]
        q_len = end - start
        mask = None
        if q_len < context_len:  # query i sees the context up to its own position
            positions = torch.arange(context_len - q_len, context_len, device=query.device)
            mask = torch.arange(context_len, device=query.device) <= positions[:, None]
        attended = F.scaled_dot_product_attention(
            q, key, value, attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        out[start:end] = attended[0].transpose(0, 1)
    return out
