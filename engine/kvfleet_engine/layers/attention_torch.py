"""Attention over the paged KV cache in plain torch: the reference every kernel is tested against.

Simple on purpose: one sequence at a time, gather its blocks, dense attention with a causal mask.
Runs on CPU and GPU in any float dtype (softmax in float32).
Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] per layer for K and for V; a
token's slot is block_id * block_size + offset. Every backend takes these signatures.

A quantized cache (`kv_cache_dtype="fp8"` or `"int8"`, the formats are argued in
`kernels/kv_fp8.py`) holds 8-bit codes (e4m3, or integers), and beside each of K and V a scales
tensor [num_blocks, num_kv_heads, block_size] bfloat16: one scale per token and kv head,
value = code * scale. `quantize_kv` is the rule every store follows bit for bit; the attention
functions read `dequantize_kv` of the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvfleet_engine.layers import kv_shaping

# k_cache, v_cache and, for a quantized cache, k_scales and v_scales (else None).
KVCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
INT8_MAX = 127.0  # symmetric integer codes: -127..127
# A quantized cache's code dtypes and their largest code (a row's largest magnitude maps to it).
CODE_MAX = {FP8_DTYPE: FP8_MAX, torch.int8: INT8_MAX}
# The kv_cache_dtype settings of a quantized cache and their code dtypes.
KV_CODES = {"fp8": FP8_DTYPE, "int8": torch.int8}
SCALE_DTYPE = torch.bfloat16
AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero


def quantize_kv(
    x: torch.Tensor,  # [..., head_dim], any float dtype
    codes_dtype: torch.dtype = FP8_DTYPE,  # a CODE_MAX key
) -> tuple[torch.Tensor, torch.Tensor]:  # codes [..., head_dim], scales [...] bfloat16
    """Each row's scale is its largest magnitude / the largest code (448 for e4m3, 127 for int8),
    rounded up to a bfloat16; the codes are the row times 1 / scale (float32), rounded to nearest
    even (e4m3's cast, or integers), so no code exceeds the largest."""
    top = CODE_MAX[codes_dtype]
    amax = x.float().abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    # A tensor divisor, not a Python float: CUDA torch divides by a scalar as a multiplication by
    # its float32 reciprocal, one ulp off the IEEE quotient (a scale one bfloat16 step too large
    # wherever amax / 448 is exactly a bfloat16); the kernels divide correctly rounded (div_rn).
    bits = (amax / amax.new_full((), top)).view(torch.int32)
    scale = ((bits + 0xFFFF) & -0x10000).view(torch.float32)  # exactly a bfloat16
    scaled = x.float() * (1.0 / scale)[..., None]
    if codes_dtype == torch.int8:
        scaled = scaled.round()
    return scaled.clamp(-top, top).to(codes_dtype), scale.to(SCALE_DTYPE)


def dequantize_kv(
    codes: torch.Tensor,  # [..., head_dim] e4m3fn or int8
    scales: torch.Tensor,  # [...]
) -> torch.Tensor:  # [..., head_dim] float32
    return codes.float() * scales.float()[..., None]


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset; -1 skips
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: quantized
    v_scales: torch.Tensor | None = None,
    k_moment: kv_shaping.KMoment | None = None,  # an fp8 K shaped by it
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for rows, cache, scales in ((key[keep], k_cache, k_scales), (value[keep], v_cache, v_scales)):
        if scales is None:
            cache[blocks, offsets] = rows.to(cache.dtype)
        else:
            codes, row_scales = quantize_kv(rows, cache.dtype)
            if k_moment is not None and cache is k_cache:  # `kv_shaping`
                codes = kv_shaping.shaped_e4m3(rows, codes, row_scales, k_moment)
            cache[blocks, offsets], scales[blocks, :, offsets] = codes, row_scales


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    context_len: int,
    scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: quantized
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim]; float32 from a quantized cache
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    rows = cache[blocks].flatten(0, 1)[:context_len]
    if scales is None:
        return rows
    row_scales = scales[blocks].transpose(1, 2).flatten(0, 1)[:context_len]
    return dequantize_kv(rows, row_scales)


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
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: quantized
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    out = torch.empty_like(query)
    for seq, context_len in enumerate(context_lens.tolist()):
        key = gather_kv(k_cache, block_tables[seq], context_len, k_scales)
        value = gather_kv(v_cache, block_tables[seq], context_len, v_scales)
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


def prefill_each_sequence(
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
    query: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """prefill_attention's loop: each sequence's query tokens attend (with `attend(query [q_len,
    heads, dim], key, value [context_len, kv_heads, dim], scale)`) to its gathered context
    (float32 from a quantized cache)."""
    k_cache, v_cache, k_scales, v_scales = cache
    out = torch.empty_like(query)
    starts = cu_query_lens.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        key = gather_kv(k_cache, block_tables[seq], context_len, k_scales)
        value = gather_kv(v_cache, block_tables[seq], context_len, v_scales)
        out[start:end] = attend(query[start:end], key, value, scale)
    return out
