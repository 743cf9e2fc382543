"""The packed weight layouts shared by the quantized linears and their kernels, with their pure
torch reference: pack from the canonical form every checkpoint format unpacks to, dequantize
back, and the product a kernel must reproduce.

Canonical form (what the AWQ, GPTQ, compressed-tensors and GGUF readers produce, per linear):
integer codes `[out, in]`, float scales and offsets per group of `group_size` input columns
`[out, in // group_size]`, weight = code * scale + offset (a zero point z is offset = -z * scale),
and optionally GPTQ's act-order `g_idx` `[in]` (the group of each input column).

Kernel layouts (K = in_features, N = out_features; N is the contiguous dimension so a decode
GEMV and a prompt GEMM tile both read whole cache lines):
- int4: `qweight` int32 [K // 8, N], the code of (k, n) in bits 4·(k % 8) .. 4·(k % 8) + 3 of
  qweight[k // 8, n] (unsigned 0..15); `scales`, `offsets` [K // group, N]; with act-order the
  input columns are stored sorted by group and `perm` [K] int64 gathers x into that order.
- int8 (weights only): `qweight` int8 [K, N], symmetric; `scales` [K // group, N] (one group of K
  for per-output-channel scales).
- fp8 (W8A8): `weight` float8_e4m3fn [N, K] (its transpose is the column-major operand
  torch._scaled_mm wants), `scale` float32 [N]; activations are quantized per token at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_PER_INT32 = 8
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor  # int32 [K // 8, N]
    scales: torch.Tensor  # [K // group, N]
    offsets: torch.Tensor  # [K // group, N]
    perm: torch.Tensor | None  # int64 [K]: act-order column order (None: natural order)
    group_size: int


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [K, N]
    scales: torch.Tensor  # [K // group, N]
    group_size: int


@dataclass(frozen=True)
class Fp8Weight:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]


# ---- int4 --------------------------------------------------------------------------------------


def pack_int4(
    codes: torch.Tensor,  # [N, K] integers in 0..15
    scales: torch.Tensor,  # [N, K // group]
    offsets: torch.Tensor,  # [N, K // group]
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K]: group of each input column (act-order)
    scale_dtype: torch.dtype = torch.float16,
) -> Int4Weight:
    in_features = codes.shape[1]
    _check_groups(in_features, group_size, scales, offsets)
    if int(codes.min()) < 0 or int(codes.max()) > 15:
        raise ValueError("int4 codes must lie in 0..15")
    perm = None
    if g_idx is not None and not torch.equal(
        g_idx.long().cpu(), torch.arange(in_features) // group_size
    ):
        perm = _act_order_permutation(g_idx.long().cpu(), in_features, group_size)
        codes = codes[:, perm.to(codes.device)]
    codes_kn = codes.t().to(torch.int32).reshape(in_features // INT4_PER_INT32, INT4_PER_INT32, -1)
    shifts = (4 * torch.arange(INT4_PER_INT32, dtype=torch.int32, device=codes.device))[:, None]
    qweight = (codes_kn << shifts).sum(dim=1, dtype=torch.int32)  # no bits overlap: sum == or
    return Int4Weight(
        qweight=qweight.contiguous(),
        scales=scales.t().to(scale_dtype).contiguous(),
        offsets=offsets.t().to(scale_dtype).contiguous(),
        perm=None if perm is None else perm.to(codes.device),
        group_size=group_size,
    )


def unpack_int4_codes(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] -> int32 codes [K, N] (in the stored column order)."""
    shifts = 4 * torch.arange(INT4_PER_INT32, dtype=torch.int32, device=qweight.device)
    codes = (qweight[:, None, :] >> shifts[None, :, None]).bitwise_and_(0xF)
    return codes.reshape(-1, qweight.shape[1])


def dequantize_int4(weight: Int4Weight) -> torch.Tensor:
    """float32 [K, N] in the stored column order (x[:, perm] @ it is the product). The CPU path
    runs this for every linear at every step, so each group's scales and offsets broadcast over
    its rows in place instead of being repeated to [K, N] (the same values, element by element)."""
    num_rows, num_cols = weight.qweight.shape[0] * INT4_PER_INT32, weight.qweight.shape[1]
    codes = unpack_int4_codes(weight.qweight).float()
    grouped = codes.view(num_rows // weight.group_size, weight.group_size, num_cols)
    grouped.mul_(weight.scales.float()[:, None, :]).add_(weight.offsets.float()[:, None, :])
    return codes


def int4_linear_reference(
    x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if weight.perm is not None:
        x = x[..., weight.perm]
    out = (x.float() @ dequantize_int4(weight)).to(x.dtype)
    return out if bias is None else out + bias


def _act_order_permutation(g_idx: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor:
    if g_idx.shape != (in_features,):
        raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({in_features},)")
    counts = torch.bincount(g_idx, minlength=in_features // group_size)
    if counts.numel() != in_features // group_size or bool((counts != group_size).any()):
        raise ValueError(f"g_idx must put exactly {group_size} input columns in every group")
    return torch.argsort(g_idx, stable=True)


def _check_groups(
    in_features: int, group_size: int, scales: torch.Tensor, offsets: torch.Tensor | None
) -> None:
    if group_size <= 0 or in_features % group_size or group_size % INT4_PER_INT32:
        raise ValueError(
            f"group size {group_size} must divide in_features ({in_features}) and be a "
            f"multiple of {INT4_PER_INT32}"
        )
    groups = in_features // group_size
    for name, tensor in (("scales", scales), ("offsets", offsets)):
        if tensor is not None and tensor.shape[1] != groups:
            raise ValueError(f"{name} have {tensor.shape[1]} groups, expected {groups}")


# ---- int8 (weights only) -----------------------------------------------------------------------


def pack_int8(
    codes: torch.Tensor,  # [N, K] int8 (symmetric)
    scales: torch.Tensor,  # [N, K // group]
    group_size: int,
    scale_dtype: torch.dtype = torch.float32,
) -> Int8Weight:
    _check_groups(codes.shape[1], group_size, scales, None)
    return Int8Weight(
        qweight=codes.t().to(torch.int8).contiguous(),
        scales=scales.t().to(scale_dtype).contiguous(),
        group_size=group_size,
    )


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric round-to-nearest int8 of a float [N, K] weight (per output channel when
    group_size is None)."""
    out_features, in_features = weight.shape
    group_size = group_size or in_features
    grouped = weight.float().reshape(out_features, in_features // group_size, group_size)
    scales = grouped.abs().amax(dim=-1).clamp(min=1e-12) / 127.0  # [N, groups]
    codes = torch.round(grouped / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return pack_int8(codes.reshape(out_features, in_features), scales, group_size)


def dequantize_int8(weight: Int8Weight) -> torch.Tensor:
    """float32 [K, N]."""
    scales = weight.scales.float().repeat_interleave(weight.group_size, dim=0)
    return weight.qweight.float() * scales


def int8_linear_reference(
    x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out = (x.float() @ dequantize_int8(weight)).to(x.dtype)
    return out if bias is None else out + bias


# ---- fp8 (W8A8) --------------------------------------------------------------------------------


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """e4m3 weights with one scale per output channel, from a float [N, K] weight."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return Fp8Weight(weight=_to_fp8(weight.float() / scale[:, None]), scale=scale)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of activations [M, K] -> (e4m3 [M, K], float32 [M, 1])."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return _to_fp8(x.float() / scale), scale


def fp8_linear_reference(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the W8A8 kernel computes: both operands rounded to e4m3, products in float32."""
    x_q, x_scale = quantize_fp8_rows(x.reshape(-1, x.shape[-1]))
    w = weight.weight.float() * weight.scale[:, None]
    out = ((x_q.float() * x_scale) @ w.t()).to(x.dtype).reshape(*x.shape[:-1], -1)
    return out if bias is None else out + bias


def fp8_weight_only_reference(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the decode-sized fp8 product computes: x as it is (not quantized) times the
    dequantized e4m3 weights, in float32 (at least as accurate as W8A8)."""
    w = weight.weight.float() * weight.scale[:, None]
    out = (x.float() @ w.t()).to(x.dtype)
    return out if bias is None else out + bias


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
