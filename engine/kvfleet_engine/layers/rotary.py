"""Rotary position embedding (rotate-half / NeoX layout), with "llama3" frequency scaling or
stored per-frequency factors."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# ROPE_TYPES: the types implemented below. It lives with config.json's checks (which import no
# torch), so a checkpoint of another type is refused before the model is built.
from kvfleet_engine.config.model_checks import ROPE_TYPES, rope_type_of


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling from a config.json (transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling`)."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = rope_type_of(params)
    if rope_type not in ROPE_TYPES:
        supported = ", ".join(ROPE_TYPES)
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {supported}")
    params["rope_type"] = rope_type
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:  # [head_dim // 2]
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if params["rope_type"] == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    elif params["rope_type"] == "frequency_factors":
        inv_freq = inv_freq / torch.tensor(params["frequency_factors"], dtype=torch.float32)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.params = params
        self.cos_sin: torch.Tensor  # [max_positions, head_dim]: cos then sin of each frequency
        self.register_buffer("cos_sin", torch.empty(max_positions, head_dim), persistent=False)

    def reset_buffers(self) -> None:
        """Fill the cos/sin table (after the module is materialised on its device)."""
        device = self.cos_sin.device
        inv_freq = inverse_frequencies(self.head_dim, self.params).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if query.is_cuda:  # one fused kernel, in place
            from kvfleet_engine.kernels.fused import rotary_embedding_

            rotary_embedding_(positions, query, key, self.cos_sin)
            return query, key
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [num_tokens, head_dim // 2] each
        cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(query.dtype)
        sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(query.dtype)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
