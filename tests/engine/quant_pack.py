"""Test-side quantizers and packers that write the published checkpoint layouts (AutoAWQ GEMM,
auto-gptq / GPTQModel, compressed-tensors), written from the formats' own descriptions, not from
the engine's readers; plus `write_quantized_checkpoint`, which turns a tiny transformers model
into a quantized checkpoint directory and the model into its dequantized reference.

Facts followed (K = in_features, N = out_features, G = group size):
- AutoAWQ `WQLinear_GEMM.from_linear`: intweight [K, N]; for each word c, nibble i (bits 4i..)
  holds column 8c + order_map[i], order_map = [0, 2, 4, 6, 1, 3, 5, 7]; the zeros [K / G, N]
  pack the same way; w = (q - z) * s.
- auto-gptq `QuantLinear.pack`: qweight [K / 8, N], row r holding inputs 8r..8r+7 at bits 4j;
  qzeros [K / G, N / 8] packed along N the same way, storing zero - 1 (GPTQModel's gptq_v2 stores
  the zero); g_idx [K]; w = (q - z) * s[g_idx].
- compressed-tensors `pack_to_int32`: values along the last dim, value j at bits 4j of word
  j // 8, signed codes stored as code + 8; the asymmetric zero point packs along dim 0.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvfleet_engine.tiny_model import build_byte_tokenizer

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


@dataclass
class Int4Groups:
    codes: torch.Tensor  # int32 [N, K], 0..15
    zeros: torch.Tensor  # int32 [N, groups], 0..15
    scales: torch.Tensor  # float32 [N, groups], representable in the checkpoint's scale dtype
    g_idx: torch.Tensor  # int32 [K]: the group of each input column

    def dequantize(self) -> torch.Tensor:  # float32 [N, K]
        g = self.g_idx.long()
        return (self.codes - self.zeros[:, g]).float() * self.scales[:, g]


def quantize_int4(
    weight: torch.Tensor,  # [N, K]
    group_size: int,
    symmetric: bool,
    act_order_seed: int | None = None,  # shuffle which columns share a group (GPTQ desc_act)
    scale_dtype: torch.dtype = torch.float16,  # what the checkpoint stores scales in
) -> Int4Groups:
    n, k = weight.shape
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    if act_order_seed is not None:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(act_order_seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = torch.arange(k, dtype=torch.int32) // group_size
    groups = k // group_size
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int32)
    for group in range(groups):
        cols = weight[:, g_idx == group].float()
        if symmetric:
            scale = cols.abs().amax(dim=1).clamp(min=1e-8) / 7.5
            zero = torch.full((n,), 8, dtype=torch.int32)
        else:
            low, high = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale = ((high - low) / 15).clamp(min=1e-8)
            zero = torch.round(-low / scale.to(scale_dtype).float()).clamp(0, 15)
        scales[:, group], zeros[:, group] = scale.to(scale_dtype).float(), zero.to(torch.int32)
    codes = torch.round(weight.float() / scales[:, g_idx.long()]) + zeros[:, g_idx.long()]
    return Int4Groups(codes.clamp(0, 15).to(torch.int32), zeros, scales, g_idx)


def _pack_words(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """int [R, C] (0..15) -> int32 [R, C / 8]: nibble i of word c holds column 8c + order[i]."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows, cols // 8, 8)
    word = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for nibble, column in enumerate(order):
        word |= grouped[..., column] << (4 * nibble)
    return _as_int32(word)


def _as_int32(word: torch.Tensor) -> torch.Tensor:
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_awq(q: Int4Groups) -> dict[str, torch.Tensor]:
    return {
        "qweight": _pack_words(q.codes.t(), AWQ_ORDER),  # [K, N / 8]
        "qzeros": _pack_words(q.zeros.t(), AWQ_ORDER),  # [K / G, N / 8]
        "scales": q.scales.t().half().contiguous(),  # [K / G, N]
    }


def pack_gptq(q: Int4Groups, v2: bool = False) -> dict[str, torch.Tensor]:
    stored_zeros = q.zeros if v2 else (q.zeros - 1) & 0xF
    return {
        "qweight": _pack_words(q.codes, list(range(8))).t().contiguous(),  # [K / 8, N]
        "qzeros": _pack_words(stored_zeros.t(), list(range(8))),  # [K / G, N / 8]
        "scales": q.scales.t().half().contiguous(),  # [K / G, N]
        "g_idx": q.g_idx.clone(),
    }


def pack_compressed_tensors(q: Int4Groups, symmetric: bool) -> dict[str, torch.Tensor]:
    n, k = q.codes.shape
    tensors = {
        "weight_packed": _pack_words(q.codes, list(range(8))),  # [N, K / 8]: code (signed + 8)
        "weight_scale": q.scales.to(torch.bfloat16),  # [N, K / G]
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:  # signed zero zp stored as zp + 8 == the unsigned zero, packed along N
        tensors["weight_zero_point"] = _pack_words(q.zeros.t(), list(range(8))).t().contiguous()
    return tensors


# ---- 8-bit -------------------------------------------------------------------------------------


def quantize_fp8_channels(weight: torch.Tensor, per_tensor: bool = False):
    """e4m3 weight [N, K] and float32 scale ([N, 1], or [1] per tensor), dequantized weight."""
    absmax = weight.abs().amax().reshape(1) if per_tensor else weight.abs().amax(1, keepdim=True)
    scale = (absmax.float() / FP8_MAX).clamp(min=1e-12)
    fp8 = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8, scale, fp8.float() * scale


def quantize_int8_channels(weight: torch.Tensor, group_size: int | None = None):
    """int8 weight [N, K], float32 scale [N, K / G] ([N, 1] per channel), dequantized weight."""
    n, k = weight.shape
    g = group_size or k
    grouped = weight.float().reshape(n, k // g, g)
    scale = grouped.abs().amax(dim=-1).clamp(min=1e-8) / 127
    codes = torch.round(grouped / scale[..., None]).clamp(-128, 127).to(torch.int8)
    return codes.reshape(n, k), scale, (codes.float() * scale[..., None]).reshape(n, k)


def fake_quantize_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """The dynamic per-token activation quantization of a W8A8 layer, as float."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (
        (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    ).to(x.dtype)


# ---- whole checkpoints -------------------------------------------------------------------------


def write_quantized_checkpoint(
    model: Any,
    directory: Path,
    method: str,
    *,
    group_size: int = 32,
    symmetric: bool = True,
    act_order: bool = False,
    gptq_v2: bool = False,
    per_tensor: bool = False,
    ignore: tuple[str, ...] = (),
) -> Any:
    """Write `model` (a float32 transformers causal LM) quantized as `method` to `directory`
    and overwrite its linear weights with the dequantized ones, so the model is the reference of
    the checkpoint (with `fp8`, call `add_fp8_activation_hooks` on it too).

    method: "awq" | "gptq" | "ct-int4" | "ct-fp8" | "ct-int8"."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    state = {name: p.detach().clone() for name, p in model.state_dict().items()}
    for name, value in state.items():
        module_name, _, leaf = name.rpartition(".")
        linear = module_name.rsplit(".", 1)[-1]
        if linear not in LINEARS or leaf != "weight" or any(i in module_name for i in ignore):
            tensors[name] = value.contiguous()
            continue
        seed = _act_order_seed(module_name) if act_order else None
        if method in ("awq", "gptq", "ct-int4"):
            scale_dtype = torch.bfloat16 if method == "ct-int4" else torch.float16
            q = quantize_int4(value, group_size, symmetric, seed, scale_dtype)
            if method == "awq":
                packed = pack_awq(q)
            elif method == "gptq":
                packed = pack_gptq(q, v2=gptq_v2)
            else:
                packed = pack_compressed_tensors(q, symmetric)
            if method == "ct-int4" and act_order:
                packed["weight_g_idx"] = q.g_idx.clone()
            dequantized = q.dequantize()
        elif method == "ct-fp8":
            fp8, scale, dequantized = quantize_fp8_channels(value, per_tensor)
            packed = {"weight": fp8, "weight_scale": scale, "input_scale": torch.ones(1)}
        elif method == "ct-int8":
            codes, scale, dequantized = quantize_int8_channels(value, group_size or None)
            packed = {"weight": codes, "weight_scale": scale}
        else:
            raise ValueError(method)
        for suffix, tensor in packed.items():
            tensors[f"{module_name}.{suffix}"] = tensor.contiguous()
        with torch.no_grad():
            model.get_submodule(module_name).weight.copy_(dequantized)
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(directory / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(
        method, group_size, symmetric, act_order, gptq_v2, per_tensor, ignore
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    build_byte_tokenizer().save_pretrained(directory)
    return model


def _act_order_seed(module_name: str) -> int:
    """One act-order per layer input, as GPTQ's (the Hessian of the input sets it): q/k/v share
    one, gate/up another."""
    prefix, _, linear = module_name.rpartition(".")
    shared_input = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
    return zlib.crc32(f"{prefix}.{shared_input.get(linear, linear)}".encode())


def quantization_config(
    method: str,
    group_size: int,
    symmetric: bool,
    act_order: bool,
    gptq_v2: bool,
    per_tensor: bool,
    ignore: tuple[str, ...],
) -> dict[str, Any]:
    """The quantization_config each tool writes into config.json."""
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(ignore) or None,
        }
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": symmetric,
            "checkpoint_format": "gptq_v2" if gptq_v2 else "gptq",
            "lm_head": False,
        }
    if method == "ct-fp8":
        weights = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "tensor" if per_tensor else "channel",
            "dynamic": False,
        }
        inputs = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        }
        fmt = "float-quantized"
    elif method == "ct-int8":
        weights = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "group" if group_size else "channel",
            "group_size": group_size or None,
        }
        inputs, fmt = None, "int-quantized"
    else:
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": symmetric,
            "strategy": "group",
            "group_size": group_size,
            "actorder": "group" if act_order else None,
        }
        inputs, fmt = None, "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ["lm_head", *(f"re:.*{name}$" for name in ignore)],
        "quantization_status": "compressed",
    }


def add_fp8_activation_hooks(model: Any) -> None:
    """Quantize each quantized linear's input per token, as a W8A8 layer does."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            module.register_forward_pre_hook(lambda _, args: (fake_quantize_fp8_rows(args[0]),))
