"""Attention over the paged KV cache in plain torch: the reference every kernel is tested against.

Simple on purpose: one sequence at a time, gather its blocks, dense attention with a causal mask.
Runs on CPU and GPU in any float dtype (softmax in float32).
Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] per layer for K and for V; a
token's slot is block_id * block_size + offset. Every backend takes these signatures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset; -1 skips
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    context_len: int,
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.flatten(0, 1)[:context_len]


def _attend(
    query: torch.Tensor,  # [q_len, num_q_heads, head_dim], the last q_len positions of the context
    key: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [q_len, num_q_heads, head_dim]
    q_len, num_q_heads, _ = query.shape
    context_len, num_kv_heads, _ = key.shape
    group = num_q_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1)  # [context_len, num_q_heads, head_dim]
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    positions = torch.arange(context_len - q_len, context_len, device=query.device)
    visible = torch.arange(context_len, device=query.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out.to(query.dtype)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    out = torch.empty_like(query)
    for seq, context_len in enumerate(context_lens.tolist()):
        key = gather_kv(k_cache, block_tables[seq], context_len)
        value = gather_kv(v_cache, block_tables[seq], context_len)
        out[seq] = _attend(query[seq : seq + 1], key, value, scale)[0]
    return out


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], sequences back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_query_lens: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32 = cached prefix + this step's query tokens
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    return prefill_each_sequence(
        _attend, query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale
    )


def prefill_each_sequence(
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """prefill_attention's loop: each sequence's query tokens attend (with `attend(query [q_len,
    heads, dim], key, value [context_len, kv_heads, dim], scale)`) to its gathered context."""
    out = torch.empty_like(query)
    starts = cu_query_lens.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        key = gather_kv(k_cache, block_tables[seq], context_len)
        value = gather_kv(v_cache, block_tables[seq], context_len)
        out[start:end] = attend(query[start:end], key, value, scale)
    return out
