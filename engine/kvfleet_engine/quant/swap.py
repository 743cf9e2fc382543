"""Swap a model's Linear / MergedLinear modules for quantized ones before its weights load, from
outside the model file (gpt-fast's order: build on meta -> swap -> load -> shard)."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet_engine.layers.linear import Linear
from kvfleet_engine.layers.norm import RMSNorm
from kvfleet_engine.quant.config import QuantConfig
from kvfleet_engine.quant.linear import QuantLinear

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: e4m3 tensor cores


def check_device(quant: QuantConfig, device: torch.device) -> None:
    """Refuse, at start-up, a scheme the device cannot run."""
    if "fp8" not in quant.kinds or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"fp8 needs compute capability >= 8.9, device {torch.cuda.get_device_name(device)} "
            f"has {major}.{minor}"
        )


def quantize_linears(model: nn.Module, quant: QuantConfig, dtype: torch.dtype) -> list[str]:
    """Replace every Linear whose checkpoint layers `quant` quantizes (create the model and call
    this under the meta device); returns the names of the replaced modules. Embeddings stay,
    and so does a tied lm_head (and, with quant.unquantized_when_mixed, a fused layer whose
    checkpoint layers have different schemes)."""
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    tied = bool(getattr(model, "tie_word_embeddings", False))
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or (name == "lm_head" and tied):
            continue
        names = checkpoint_names(name, module, packed)
        schemes = {quant.scheme_for(checkpoint_name) for checkpoint_name in names.values()}
        if len(schemes) > 1 and quant.unquantized_when_mixed:
            continue
        if len(schemes) > 1:
            raise ValueError(
                f"{name}: its checkpoint layers {sorted(names.values())} are quantized "
                "differently; one fused layer needs one scheme"
            )
        scheme = schemes.pop()
        if scheme is None:
            continue
        out_features, in_features = module.weight.shape
        shards = {shard: rows for shard, (_, rows) in module.shard_offsets().items()}
        layer = QuantLinear(
            in_features, shards, out_features, module.bias is not None, scheme, dtype
        )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        replaced.append(name)
    _quantizing_norms(model)
    return replaced


def _quantizing_norms(model: nn.Module) -> None:
    """A norm whose output feeds only an fp8 linear (a module's `norm_consumers`) hands it the
    rows quantized per token (RMSNorm.fp8_rows_out): one kernel instead of two, and the
    16-bit rows never written."""
    for module in model.modules():
        for norm_name, linear_name in getattr(module, "norm_consumers", {}).items():
            norm, linear = module.get_submodule(norm_name), module.get_submodule(linear_name)
            if isinstance(norm, RMSNorm) and isinstance(linear, QuantLinear):
                norm.fp8_rows_out = linear.scheme.kind == "fp8"


def checkpoint_names(
    name: str, module: Linear | QuantLinear, packed: dict[str, tuple[str, str]]
) -> dict[str | None, str]:
    """Shard (None: unfused) -> the checkpoint module it loads from, e.g. qkv_proj's "k" ->
    model.layers.0.self_attn.k_proj."""
    if not module.shard_offsets():
        return {None: name}
    prefix, _, fused = name.rpartition(".")
    parts = {shard: part for part, (fused_name, shard) in packed.items() if fused_name == fused}
    return {shard: f"{prefix}.{parts[shard]}" for shard in module.shard_offsets()}
