"""What a quantized linear reads from a checkpoint: each tensor's name, shape, dtype and how a
fused layer's shard or a tensor-parallel split cuts it, per checkpoint layout (float, the
compressed-tensors float / int / pack layouts, AutoAWQ, GPTQ, GGUF's repacked blocks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet_engine.quant.config import WeightScheme
from kvfleet_engine.quant.layout import FP8_DTYPE


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor a quantized linear reads from the checkpoint (`<module>.<name>`)."""

    name: str
    shape: tuple[int, ...]  # the whole tensor, every shard of a fused layer included
    dtype: torch.dtype
    # How a fused layer's shard lands: "slice" (its rows / columns along shard_dim), "equal"
    # (every shard holds the whole tensor, and they must agree: act-order g_idx), "shape" (a
    # weight_shape record, checked, not kept), "ignored" (read and dropped).
    kind: str = "slice"
    shard_dim: int = 0
    pack: int = 1  # values per element along shard_dim (shard offsets divide by it)
    optional: bool = False  # may be absent from the checkpoint
    broadcast: bool = False  # a one-element tensor fills the shard's slice (per-tensor scales)
    # The dimension along the input features (or groups of them), None if there is none, and
    # how many input features one element there covers (0: all of them, one group): what a
    # split of the input features (a row-parallel layer) cuts.
    k_dim: int | None = None
    k_per: int = 1


def checkpoint_tensors(
    scheme: WeightScheme, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
) -> list[CheckpointTensor]:
    """The tensors of one linear in the scheme's checkpoint layout (dtype: the serving dtype)."""
    k, n = in_features, out_features
    groups = k // (scheme.group_size or k)
    group = scheme.group_size or 0  # input features per scale (0: one group over all of them)
    T = CheckpointTensor
    found: list[CheckpointTensor]
    if scheme.layout == "float":
        found = [T("weight", (n, k), dtype, k_dim=1)]
    elif scheme.layout == "ct-float":
        found = [
            T("weight", (n, k), FP8_DTYPE, k_dim=1),
            T("weight_scale", (n, 1), torch.float32, broadcast=True),
            # A static activation scale from calibration: we quantize activations per token at
            # run time instead (dynamic), which is at least as accurate.
            T("input_scale", (1,), torch.float32, kind="ignored", optional=True),
        ]
    elif scheme.layout == "ct-int":
        found = [
            T("weight", (n, k), torch.int8, k_dim=1),
            T("weight_scale", (n, groups), torch.float32, broadcast=True, k_dim=1, k_per=group),
        ]
    elif scheme.layout == "ct-pack":
        per_word = 32 // bits(scheme)
        found = [
            T("weight_packed", (n, k // per_word), torch.int32, k_dim=1, k_per=per_word),
            T("weight_scale", (n, groups), torch.float32, k_dim=1, k_per=group),
            T("weight_g_idx", (k,), torch.int32, kind="equal", optional=True, k_dim=0),
            T("weight_shape", (2,), torch.int64, kind="shape"),
        ]
        if not scheme.symmetric:
            found.append(
                T("weight_zero_point", (n // 8, groups), torch.int32, pack=8, k_dim=1, k_per=group)
            )
    elif scheme.layout == "awq":
        found = [
            T("qweight", (k, n // 8), torch.int32, shard_dim=1, pack=8, k_dim=0),
            T("qzeros", (groups, n // 8), torch.int32, shard_dim=1, pack=8, k_dim=0, k_per=group),
            T("scales", (groups, n), torch.float32, shard_dim=1, k_dim=0, k_per=group),
        ]
    elif scheme.layout == "gptq":
        per_word = 32 // bits(scheme)
        found = [
            T("qweight", (k // per_word, n), torch.int32, shard_dim=1, k_dim=0, k_per=per_word),
            T(
                "qzeros",
                (groups, n // per_word),
                torch.int32,
                shard_dim=1,
                pack=per_word,
                k_dim=0,
                k_per=group,
            ),
            T("scales", (groups, n), torch.float32, shard_dim=1, k_dim=0, k_per=group),
            T("g_idx", (k,), torch.int32, kind="equal", optional=True, k_dim=0),
        ]
    elif scheme.layout == "gguf":  # loaders/gguf_tensors.py's repacked blocks
        found = [
            T("codes", (n, k), torch.uint8 if scheme.kind == "int4" else torch.int8, k_dim=1),
            T("scales", (n, groups), torch.float32, k_dim=1, k_per=group),
        ]
        if scheme.kind == "int4":
            found.append(T("offsets", (n, groups), torch.float32, k_dim=1, k_per=group))
    else:
        raise ValueError(f"unknown checkpoint layout {scheme.layout!r}")
    if bias:
        found.append(T("bias", (n,), dtype))
    return found


def bits(scheme: WeightScheme) -> int:
    return 4 if scheme.kind == "int4" else 8
