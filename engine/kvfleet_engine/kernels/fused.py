"""Fused element-wise kernels for the decoder layer: rotary embedding applied in place to q and
k, alone or together with the store of k and v into the paged cache (quantized for an fp8 or int8
cache, as `kv_store` does). Each replaces a chain of small torch ops or kernels (one launch and one
round trip to memory each) that dominates a batch-1 step's non-matmul time; the residual add +
RMSNorm is `rms_norm`'s."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.checks import (
    check_cache,
    check_rotary,
    check_rotary_store,
    next_power_of_2,
)
from kvfleet_engine.kernels.hadamard import hadamard_halves
from kvfleet_engine.kernels.kv_fp8 import kv_scales, row_amax, to_codes
from kvfleet_engine.kernels.kv_shaping import SHAPE_STEPS as _SHAPE_STEPS
from kvfleet_engine.kernels.kv_shaping import shaped_e4m3_halves, shaped_launch
from kvfleet_engine.kernels.pdl import _start, launch_options
from kvfleet_engine.layers.kv_shaping import KMoment


@triton.jit
def _cos_sin(
    positions_ptr, token, cos_sin_ptr, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    """This token's row of the table: cos and sin of each frequency, [1, BLOCK_HALF] each."""
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + position * stride_cs + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + cols, mask=cols < HALF, other=0.0)
    return cos, sin


@triton.jit
def _rotate_heads_(
    x_ptr,
    token,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HADAMARD: tl.constexpr = False,
):
    """Rotate in place this token's heads of x ([tokens, heads, head_dim] by its strides), then
    with HADAMARD times the Hadamard matrix (`layers.kv_rotation`; BLOCK_HALF == HALF); returns
    the head indices [BLOCK_H, 1], their mask and the two rotated halves, rounded to x's dtype."""
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & (cols < HALF)
    first = x_ptr + token * stride_t + heads * stride_h + cols
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    r1, r2 = f1 * cos - f2 * sin, f2 * cos + f1 * sin
    if HADAMARD:
        r1, r2 = hadamard_halves(r1, r2, BLOCK_H, BLOCK_HALF)
    out1, out2 = r1.to(x1.dtype), r2.to(x1.dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return heads, mask, out1, out2


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr = False,
):
    _start(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(positions_ptr, token, cos_sin_ptr, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads_(
        query_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, HALF, BLOCK_QH, BLOCK_HALF
    )
    _rotate_heads_(
        key_ptr, token, stride_kt, stride_kh, num_kv_heads, cos, sin, HALF, BLOCK_KVH, BLOCK_HALF
    )


@triton.jit
def _rotary_store_kv_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scales_ptr,  # a quantized cache only: [num_blocks, num_kv_heads, block_size] bfloat16
    v_scales_ptr,
    k_factors_ptr,  # SHAPED only: [num_kv_heads, HEAD_DIM, RANK] float32 (`kv_shaping.KMoment`)
    k_isotropic_ptr,  # SHAPED only: [num_kv_heads] float32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_cb,
    stride_cslot,
    stride_ch,
    stride_cvb,  # the V cache's own strides: its rows (K's layout) or token major (`checks`)
    stride_cvs,
    stride_cvh,
    stride_cvd,
    stride_sb,
    stride_sh,
    num_q_heads,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    FP8: tl.constexpr,
    HADAMARD: tl.constexpr,
    SHAPED: tl.constexpr = False,
    RANK: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    _start(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(positions_ptr, token, cos_sin_ptr, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads_(
        query_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, HALF, BLOCK_QH, BLOCK_HALF,
        HADAMARD,
    )  # fmt: skip
    heads, mask, k1, k2 = _rotate_heads_(
        key_ptr, token, stride_kt, stride_kh, num_kv_heads, cos, sin, HALF, BLOCK_KVH, BLOCK_HALF,
        HADAMARD,
    )  # fmt: skip

    cols = tl.arange(0, BLOCK_HALF)[None, :]
    slot = tl.load(slot_mapping_ptr + token)
    row_mask = (heads < num_kv_heads) & (slot >= 0)  # [BLOCK_KVH, 1]
    mask = mask & (slot >= 0)
    slot = tl.maximum(slot, 0)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cslot + heads * stride_ch
    v_dst = block * stride_cvb + offset * stride_cvs + heads * stride_cvh
    v_first = value_ptr + token * stride_vt + heads * stride_vh + cols
    v1 = tl.load(v_first, mask=mask, other=0.0)
    v2 = tl.load(v_first + HALF, mask=mask, other=0.0)
    if FP8:  # a quantized cache: each head's scale covers both of its halves
        k_ty = k_cache_ptr.dtype.element_ty
        v_ty = v_cache_ptr.dtype.element_ty
        k_scale, k_inverse = kv_scales(tl.maximum(row_amax(k1), row_amax(k2)), k_ty)
        v_scale, v_inverse = kv_scales(tl.maximum(row_amax(v1), row_amax(v2)), v_ty)
        scale_dst = block * stride_sb + heads * stride_sh + offset  # [BLOCK_KVH, 1]
        tl.store(k_scales_ptr + scale_dst, k_scale.to(tl.bfloat16)[:, None], mask=row_mask)
        tl.store(v_scales_ptr + scale_dst, v_scale.to(tl.bfloat16)[:, None], mask=row_mask)
        if SHAPED:  # K rounded toward the queries
            k1, k2 = shaped_e4m3_halves(
                k1, k2, k_inverse[:, None], k_factors_ptr, k_isotropic_ptr, heads, cols, mask,
                HALF, _SHAPE_STEPS, RANK,
            )  # fmt: skip
        else:
            k1 = to_codes(k1, k_inverse[:, None], k_ty)
            k2 = to_codes(k2, k_inverse[:, None], k_ty)
        v1, v2 = to_codes(v1, v_inverse[:, None], v_ty), to_codes(v2, v_inverse[:, None], v_ty)
    tl.store(k_cache_ptr + dst + cols, k1, mask=mask)
    tl.store(k_cache_ptr + dst + HALF + cols, k2, mask=mask)
    tl.store(v_cache_ptr + v_dst + cols * stride_cvd, v1, mask=mask)
    tl.store(v_cache_ptr + v_dst + (HALF + cols) * stride_cvd, v2, mask=mask)


def rotary_embedding_(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin: torch.Tensor,  # [max_positions, head_dim] float32: cos | sin halves
) -> None:
    """Rotate-half (NeoX) rotary embedding, in place."""
    check_rotary(positions, query, key, cos_sin)
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin.stride(0),
        num_q_heads,
        key.shape[1],
        HALF=head_dim // 2,
        BLOCK_QH=next_power_of_2(num_q_heads),
        BLOCK_KVH=next_power_of_2(key.shape[1]),
        BLOCK_HALF=next_power_of_2(head_dim // 2),
        **launch_options(query.device),
    )


def rotary_store_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: torch.Tensor,  # [max_positions, head_dim] float32: cos | sin halves
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the store, not the rotation
    *,
    k_scales: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size]: quantized
    v_scales: torch.Tensor | None = None,
    hadamard: bool = False,  # q and k also times the Hadamard matrix (`layers.kv_rotation`)
    k_moment: KMoment | None = None,  # K shaped by it (`layers.kv_shaping`)
) -> None:
    """`rotary_embedding_` then `store_kv` of the rotated key and the value, in one launch: the
    decoder layer's two smallest kernels, each a few microseconds of launch latency at batch 1."""
    check_cache(k_cache, v_cache, k_scales, v_scales)
    check_rotary_store(positions, query, key, value, cos_sin, k_cache, slot_mapping)
    num_tokens, num_q_heads, head_dim = query.shape
    if hadamard and head_dim & (head_dim - 1):
        raise ValueError(f"hadamard=True needs a power-of-two head size, got {head_dim}")
    num_kv_heads = key.shape[1]
    shaped, shaping = shaped_launch(k_moment, k_cache, k_scales, num_kv_heads, head_dim)
    if num_tokens == 0:
        return
    _rotary_store_kv_kernel[(num_tokens,)](
        positions,
        query,
        key,
        value,
        cos_sin,
        k_cache,
        v_cache,
        slot_mapping,
        k_scales if k_scales is not None else k_cache,  # a float cache: never read
        v_scales if v_scales is not None else v_cache,
        *shaped,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos_sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        k_scales.stride(0) if k_scales is not None else 0,
        k_scales.stride(1) if k_scales is not None else 0,
        num_q_heads,
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        HALF=head_dim // 2,
        BLOCK_QH=next_power_of_2(num_q_heads),
        BLOCK_KVH=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(head_dim // 2),
        FP8=k_scales is not None,
        HADAMARD=hadamard,
        **shaping,
        **launch_options(query.device),
    )
