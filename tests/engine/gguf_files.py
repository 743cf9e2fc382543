"""Write GGUF files for tests the way llama.cpp's converter does: its tensor names, its
query/key row permutation for `llama`, its metadata keys, the tokenizer in the metadata."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf_pack import SUPPORTED, quantize

from kvfleet_engine.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS
from kvfleet_engine.tokenizer import byte_symbols

_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[module]}.{kind}"


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved."""
    shape = weight.shape
    return (
        weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def add_byte_tokenizer(writer: gguf.GGUFWriter) -> None:
    """kvfleet's tiny byte-level tokenizer, as a `gpt2` GGUF vocabulary."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([*byte_symbols(), *SPECIAL_TOKENS])
    writer.add_token_types([1] * 256 + [3] * len(SPECIAL_TOKENS))
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(
    model: Any,
    path: Path,
    qtype: Callable[[str, np.ndarray], gguf.GGMLQuantizationType] | None = None,
    *,
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
    skip: frozenset[str] = frozenset(),
) -> Path:
    """Write a transformers model as a GGUF file. qtype(gguf_name, weight) picks each 2-D
    tensor's type (default F32; norms and biases stay F32); `metadata` may add or override keys;
    `skip` leaves tensors out (to make a broken file)."""
    cfg = model.config
    arch = _ARCHS[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    num_heads, num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_vocab_size(cfg.vocab_size)
    add_byte_tokenizer(writer)
    if metadata is not None:
        metadata(writer)
    if rope.get("rope_type") == "llama3":  # stored as per-frequency factors
        scaled = model.model.rotary_emb.inv_freq.float()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        base = 1.0 / (float(rope["rope_theta"]) ** exponent)
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for hf_name, param in model.state_dict().items():
        if (tied and hf_name == "lm_head.weight") or "rotary_emb" in hf_name:
            continue
        name = gguf_name(hf_name)
        if name in skip:
            continue
        weight = param.detach().float().numpy()
        if arch == "llama" and ".attn_q." in name:
            weight = permute_rows(weight, num_heads)
        elif arch == "llama" and ".attn_k." in name:
            weight = permute_rows(weight, num_kv_heads)
        if weight.ndim != 2:  # norms and biases
            writer.add_tensor(name, weight)
            continue
        kind = gguf.GGMLQuantizationType.F32 if qtype is None else qtype(name, weight)
        if kind in SUPPORTED:
            raw = quantize(np.ascontiguousarray(weight), kind)
        else:  # a type the engine does not read: the right number of (random) bytes
            block, size = gguf.GGML_QUANT_SIZES[kind]
            rows, cols = weight.shape
            raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), np.uint8)
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
