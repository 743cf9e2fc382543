"""A GGUF file's tensors under Hugging Face names, dequantized to float32.

llama.cpp's converter renames every tensor (`blk.3.attn_q.weight`), and for the `llama`
architecture it permutes the rows of the query and key projections (it stores each head's
rotary pairs interleaved; Hugging Face checkpoints keep them in halves). Both are undone here,
so the model code loads a GGUF file exactly like a safetensors directory."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvfleet_engine.loaders.gguf_metadata import TENSOR_TYPES, field, head_counts, open_gguf

# GGUF name -> Hugging Face name; {i} is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Consumed by the config (llama 3 rope frequency factors), not a model weight.
_CONFIG_TENSORS = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in the model")
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's query/key row permutation: per head, rows [x0, y0, x1, y1, ...] back to
    [x0, x1, ..., y0, y1, ...] (weight: [num_heads * head_dim, ...] or a bias [num_heads *
    head_dim])."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array in the Hugging Face shape) for every model tensor."""
    import gguf

    reader = open_gguf(path)
    arch = field(reader, "general.architecture")
    num_heads, num_kv_heads = head_counts(reader, arch) if arch == "llama" else (0, 0)
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name)
        weight = _dequantize(tensor, gguf)
        if arch == "llama" and ".q_proj." in name:
            weight = unpermute_rows(weight, num_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = unpermute_rows(weight, num_kv_heads)
        yield name, weight


def _dequantize(tensor: Any, gguf: Any) -> np.ndarray:
    type_name = tensor.tensor_type.name
    if type_name not in TENSOR_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {type_name}, which kvfleet does not read; "
            f"supported: {', '.join(TENSOR_TYPES)}"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # F32 tensors come back as read-only views of the memory map: copy those.
        return np.array(
            values, dtype=np.float32, copy=True if not values.flags.writeable else None
        ).reshape(shape)
    except ValueError as error:  # a short (truncated) data region
        raise ValueError(
            f"GGUF tensor {tensor.name!r}: {type_name} data does not hold shape {shape} ({error})"
        ) from error
