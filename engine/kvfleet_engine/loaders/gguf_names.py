"""GGUF tensor names as Hugging Face names, and the GGML type of each linear layer's weight (which
the quantization setting reads before any tensor data). No numpy of our own: config.py uses it.

llama.cpp's converter renames every tensor (`blk.3.attn_q.weight`); the model code loads under
the Hugging Face names (`model.layers.3.self_attn.q_proj.weight`)."""

from __future__ import annotations

import re

from kvfleet_engine.loaders.gguf_metadata import open_gguf

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
_LAYER_LINEARS = frozenset(
    {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
)
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Consumed by the config (llama 3 rope frequency factors), not a model weight.
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in the model")
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def gguf_tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape ([out, in] for a linear) of every model tensor in the file."""
    return {
        hf_name(tensor.name): tuple(int(n) for n in reversed(tensor.shape))  # innermost first
        for tensor in open_gguf(path).tensors
        if tensor.name not in CONFIG_TENSORS
    }


def gguf_linear_types(path: str) -> dict[str, str]:
    """Hugging Face module name of each transformer-block linear (q/k/v/o, gate/up/down) -> the
    GGML type name of its weight, e.g. {"model.layers.0.self_attn.q_proj": "Q4_K"}. The
    embedding and lm_head are not listed."""
    types = {}
    for tensor in open_gguf(path).tensors:
        match = _LAYER_TENSOR.fullmatch(tensor.name)
        if match is not None and match[2] in _LAYER_LINEARS and match[3] == "weight":
            types[hf_name(tensor.name).removesuffix(".weight")] = tensor.tensor_type.name
    return types
