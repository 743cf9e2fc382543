"""Write each token's K and V rows into its cache slot (`slot_mapping`; -1 skips the token); into
a quantized cache as 8-bit codes (e4m3 or int8, the cache's type) and a scale per row
(`kv_fp8`), an fp8 K rounded toward the queries where the layer has a moment (`kv_shaping`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import (
    check_cache,
    check_heads,
    check_index,
    next_power_of_2,
)
from kvfleet_engine.kernels.kv_fp8 import kv_scales, quantize_rows, row_amax
from kvfleet_engine.kernels.kv_shaping import SHAPE_STEPS as _SHAPE_STEPS
from kvfleet_engine.kernels.kv_shaping import shaped_e4m3_halves, shaped_launch
from kvfleet_engine.layers.kv_shaping import KMoment


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scales_ptr,  # a quantized cache only: [num_blocks, num_kv_heads, block_size] bfloat16
    v_scales_ptr,
    k_factors_ptr,  # SHAPED only: [num_kv_heads, HEAD_DIM, RANK] float32 (`kv_shaping.KMoment`)
    k_isotropic_ptr,  # SHAPED only: [num_kv_heads] float32
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cvb,  # the V cache's own strides: its rows (K's layout) or token major (`checks`)
    stride_cvs,
    stride_cvh,
    stride_cvd,
    stride_sb,
    stride_sh,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    SHAPED: tl.constexpr = False,
    RANK: tl.constexpr = 1,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    row_mask = (heads < num_kv_heads) & (slot >= 0)  # [BLOCK_H, 1]
    mask = row_mask & (dims < HEAD_DIM)
    slot = tl.maximum(slot, 0)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + heads * stride_ch
    v_dst = block * stride_cvb + offset * stride_cvs + heads * stride_cvh
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    if not SHAPED:  # K's full rows, stored below
        key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    else:  # K as halves (`kv_shaping`), stored here
        half = tl.arange(0, BLOCK_D // 2)[None, :]
        half_mask = row_mask & (half < HEAD_DIM // 2)
        first = key_ptr + token * stride_kt + heads * stride_kh + half
        k1 = tl.load(first, mask=half_mask, other=0.0)
        k2 = tl.load(first + HEAD_DIM // 2, mask=half_mask, other=0.0)
        amax = tl.maximum(row_amax(k1), row_amax(k2))
        k_scale, k_inverse = kv_scales(amax, k_cache_ptr.dtype.element_ty)
        k1, k2 = shaped_e4m3_halves(
            k1, k2, k_inverse[:, None], k_factors_ptr, k_isotropic_ptr, heads, half, half_mask,
            HEAD_DIM // 2, _SHAPE_STEPS, RANK,
        )  # fmt: skip
        tl.store(k_cache_ptr + dst + half, k1, mask=half_mask)
        tl.store(k_cache_ptr + dst + HEAD_DIM // 2 + half, k2, mask=half_mask)
        k_scale = k_scale.to(tl.bfloat16)
    if FP8:
        if not SHAPED:
            key, k_scale = quantize_rows(key, k_cache_ptr.dtype.element_ty)
        value, v_scale = quantize_rows(value, v_cache_ptr.dtype.element_ty)
        scale_dst = block * stride_sb + heads * stride_sh + offset  # [BLOCK_H, 1]
        tl.store(k_scales_ptr + scale_dst, k_scale[:, None], mask=row_mask)
        tl.store(v_scales_ptr + scale_dst, v_scale[:, None], mask=row_mask)
    if not SHAPED:
        tl.store(k_cache_ptr + dst + dims, key, mask=mask)
    tl.store(v_cache_ptr + v_dst + dims * stride_cvd, value, mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the token
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: quantized
    v_scales: torch.Tensor | None = None,
    k_moment: KMoment | None = None,  # K shaped by it (`layers.kv_shaping`)
) -> None:
    check_cache(k_cache, v_cache, k_scales, v_scales)
    check_heads(key, "key", k_cache, per_kv_head=True)
    check_heads(value, "value", k_cache, per_kv_head=True)
    check_index(slot_mapping, "slot_mapping", 1, torch.int64, k_cache.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape[0] != num_tokens:
        raise ValueError("key, value and slot_mapping must have the same number of tokens")
    shaped, shaping = shaped_launch(k_moment, k_cache, k_scales, num_kv_heads, head_dim)
    if num_tokens == 0:
        return
    # Without scales (a float cache) their pointers are the cache's and strides 0: never used.
    k_scales_arg = k_scales if k_scales is not None else k_cache
    v_scales_arg = v_scales if v_scales is not None else v_cache
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scales_arg,
        v_scales_arg,
        *shaped,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        k_scales.stride(0) if k_scales is not None else 0,
        k_scales.stride(1) if k_scales is not None else 0,
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        FP8=k_scales is not None,
        **shaping,
    )
