"""Attention over the paged KV cache with torch's `scaled_dot_product_attention`: the CPU backend.

A decode step is one attention call for the whole batch: every sequence's slots are gathered into
one padded [num_seqs, context, kv_heads, head_dim] batch, the padding masked. A prompt step is one
call per sequence (its query is the last tokens of its context: causal from the bottom right).
Grouped-query heads are shared, not copied (`enable_gqa`). Same signatures and cache layout as the
reference, `attention_torch`, whose `store_kv` it uses; a quantized cache is dequantized (to the
query's dtype) as it is gathered.

`rotary_decode_attention` is a decode step's rotation, store and attention in one call, with what
every layer of the step shares (the rotary cos/sin of its positions, the slots to store, the
blocks to gather) worked out once per step, not once per layer: on a CPU a small model's step
spends as much time on those few-element ops as in attention itself. A batch whose sequences
have one length (batch 1 always) gathers whole blocks, one `index_select` per K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfleet_engine.layers.attention_torch import dequantize_kv, prefill_each_sequence, store_kv

__all__ = ["paged_decode_attention", "prefill_attention", "rotary_decode_attention", "store_kv"]


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: quantized
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
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: quantized
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
    key, value = key.to(query.dtype), value.to(query.dtype)  # float32 from a quantized cache
    mask = None
    if q_len < context_len:  # query i sees the context up to its own position
        positions = torch.arange(context_len - q_len, context_len, device=query.device)
        mask = torch.arange(context_len, device=query.device) <= positions[:, None]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


@dataclass
class _DecodeStep:
    """What every layer of one decode step shares, keyed by the identity of the step's tensors
    (the runner makes new ones each step; this module holds them, so no id is reused)."""

    inputs: tuple[torch.Tensor, ...]  # (positions, slot_mapping, block_tables, context_lens)
    cos: torch.Tensor  # [num_seqs, 1, head_dim]: cos of each frequency, twice (rotate-half)
    sin: torch.Tensor  # [num_seqs, 1, head_dim]
    rows: torch.Tensor | None  # [stored] int64: the rows with a slot (None: every row)
    slots: torch.Tensor  # [stored] int64: where those rows go in the flattened cache
    # [num_seqs * blocks_per_seq] int64 when every sequence has context_len tokens (None: the
    # lengths differ, so paged_decode_attention's padded gather)
    blocks: torch.Tensor | None
    context_len: int


_step: _DecodeStep | None = None


def _decode_step(
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> _DecodeStep:
    global _step
    inputs = (positions, slot_mapping, block_tables, context_lens)
    if _step is not None and all(a is b for a, b in zip(_step.inputs, inputs, strict=True)):
        return _step
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [num_seqs, head_dim // 2] each
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]
    rows, slots = None, slot_mapping
    if bool((slot_mapping < 0).any()):
        rows = torch.nonzero(slot_mapping >= 0).flatten()
        slots = slot_mapping[rows]
    lens = context_lens.tolist()
    blocks = None
    if min(lens) == max(lens):
        per_seq = -(-lens[0] // block_size)
        blocks = block_tables[:, :per_seq].flatten().long()
    _step = _DecodeStep(inputs, cos, sin, rows, slots, blocks, lens[0])
    return _step


def rotary_decode_attention(
    positions: torch.Tensor,  # [num_seqs] int64
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], before rotary
    key: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim], before rotary
    value: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim]
    cos_sin: torch.Tensor,  # [max_positions, head_dim]: cos then sin of each frequency
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_seqs] int64, -1 = skip
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: quantized
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """A decode step's attention layer: rotate query and key, store key and value, attend.
    The same result as RotaryEmbedding, then store_kv, then paged_decode_attention."""
    block_size = k_cache.shape[1]
    step = _decode_step(positions, cos_sin, slot_mapping, block_tables, context_lens, block_size)
    cos, sin = step.cos.to(query.dtype), step.sin.to(query.dtype)
    query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
    if (
        k_scales is not None
    ):  # a quantized cache: quantized as it is stored, dequantized as gathered
        store_kv(key, value, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)
        return paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale,
            k_scales=k_scales, v_scales=v_scales,
        )  # fmt: skip
    if step.rows is not None:
        key, value = key[step.rows], value[step.rows]
    flat = (-1, *k_cache.shape[2:])  # [num_blocks * block_size, kv_heads, dim]: views, stored to
    k_cache.view(flat).index_copy_(0, step.slots, key.to(k_cache.dtype))
    v_cache.view(flat).index_copy_(0, step.slots, value.to(v_cache.dtype))
    if step.blocks is None:
        return paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
    num_seqs, context_len = query.shape[0], step.context_len
    shape = (num_seqs, -1, *k_cache.shape[2:])  # [num_seqs, blocks * block_size, kv_heads, dim]
    keys = k_cache.index_select(0, step.blocks).view(shape)[:, :context_len]
    values = v_cache.index_select(0, step.blocks).view(shape)[:, :context_len]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [num_seqs, num_q_heads, 1, head_dim]
        keys.transpose(1, 2),  # [num_seqs, num_kv_heads, context_len, head_dim]
        values.transpose(1, 2),
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [num_seqs, heads, head_dim] (as layers/rotary.py)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
