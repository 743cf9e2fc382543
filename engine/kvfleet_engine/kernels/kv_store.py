"""Write each token's K and V rows into its cache slot (`slot_mapping`; -1 skips the token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import check_cache, check_heads, check_index, next_power_of_2


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM) & (slot >= 0)
    slot = tl.maximum(slot, 0)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads * stride_ch
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst + dims, key, mask=mask)
    tl.store(v_cache_ptr + dst + dims, value, mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the token
) -> None:
    check_cache(k_cache, v_cache)
    check_heads(key, "key", k_cache, per_kv_head=True)
    check_heads(value, "value", k_cache, per_kv_head=True)
    check_index(slot_mapping, "slot_mapping", 1, torch.int64, k_cache.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape[0] != num_tokens:
        raise ValueError("key, value and slot_mapping must have the same number of tokens")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
    )
