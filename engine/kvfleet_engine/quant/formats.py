"""Checkpoint int4/int8 layouts unpacked to layout.py's canonical form: codes [out, in] (unsigned),
scales and offsets [out, in // group], weight = code * scale + offset.

The published layouts (K = in_features, N = out_features, G = group size):
- AutoAWQ GEMM: `qweight` int32 [K, N / 8] and `qzeros` int32 [K / G, N / 8] packed along N,
  nibble i of a word holding column 8c + AWQ_ORDER[i]; `scales` [K / G, N]; w = (q - z) * s.
- GPTQ (auto-gptq, GPTQModel): `qweight` int32 [K / (32 / bits), N] packed along K, value j of a
  word in bits bits·j..; `qzeros` int32 [K / G, N / (32 / bits)] packed along N the same way;
  `scales` [K / G, N]; `g_idx` [K]; w = (q - z) * s with z = stored + 1 in format "gptq" (v1
  stores zero - 1) and z = stored in "gptq_v2". Symmetric checkpoints have z = 2^(bits - 1).
- compressed-tensors pack-quantized: `weight_packed` int32 [N, K / 8] packed along K in value
  order (pack_to_int32), each signed code stored as code + 8 (8-bit: [N, K / 4], code + 128);
  `weight_zero_point` (asymmetric only) int32 [N / 8, K / G] packed along N the same way;
  `weight_scale` [N, K / G];
  w = (q - zp) * s in signed terms, so an unsigned code c has offset -(zp + 8) * s.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of 8
_AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(column) for column in range(8))  # (0, 4, 1, 5, ...)


def unpack_along_last(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C / (32 / bits)] -> int32 [R, C]: value j of each word in bits bits·j.."""
    per_word = 32 // bits
    shifts = bits * torch.arange(per_word, dtype=torch.int32, device=packed.device)
    values = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # [R, C / per_word, per_word]
    return values.reshape(*packed.shape[:-1], -1)


def unpack_along_first(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R / (32 / bits), C] -> int32 [R, C]."""
    return unpack_along_last(packed.t(), bits).t()


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C / 8] -> int32 [R, C] in column order."""
    nibbles = unpack_along_last(packed, 4).reshape(packed.shape[0], -1, 8)
    return nibbles[..., list(_AWQ_COLUMN_NIBBLE)].reshape(packed.shape[0], -1)


def awq_canonical(
    qweight: torch.Tensor,  # int32 [K, N / 8]
    qzeros: torch.Tensor,  # int32 [K / G, N / 8]
    scales: torch.Tensor,  # [K / G, N]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = unpack_awq(qweight).t()  # [N, K]
    zeros = unpack_awq(qzeros).t().float()  # [N, K / G]
    scales_nk = scales.t().float()
    return codes, scales_nk, -zeros * scales_nk


def gptq_canonical(
    qweight: torch.Tensor,  # int32 [K / (32 / bits), N]
    qzeros: torch.Tensor,  # int32 [K / G, N / (32 / bits)]
    scales: torch.Tensor,  # [K / G, N]
    bits: int,
    zeros_minus_one: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = unpack_along_first(qweight, bits).t()  # [N, K]
    # v1 adds one after unpacking, without masking (as auto-gptq's and vLLM's kernels do).
    zeros = unpack_along_last(qzeros, bits).t().float() + int(zeros_minus_one)  # [N, K / G]
    scales_nk = scales.t().float()
    return codes, scales_nk, -zeros * scales_nk


def compressed_tensors_canonical(
    weight_packed: torch.Tensor,  # int32 [N, K / 8]
    weight_scale: torch.Tensor,  # [N, K / G]
    weight_zero_point: torch.Tensor | None,  # int32 [N / 8, K / G] (asymmetric) or None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = unpack_along_last(weight_packed, 4)  # [N, K]: signed code + 8
    scales = weight_scale.float()
    if weight_zero_point is None:
        return codes, scales, -8.0 * scales
    zeros_unsigned = unpack_along_first(weight_zero_point, 4).float()  # zp + 8, [N, K / G]
    return codes, scales, -zeros_unsigned * scales
