"""Named model shapes for benchmarks: the public configs of real models, built with random
weights (no checkpoint needed), saved once so the engine and `transformers` read the same ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# name -> (architecture, config.json fields)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.1-8b": (
        "LlamaForCausalLM",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={**LLAMA3_ROPE, "factor": 8.0},
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-8b": (
        "Qwen3ForCausalLM",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
    ),
    "llama-3.2-1b": (
        "LlamaForCausalLM",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={**LLAMA3_ROPE, "factor": 32.0},
            tie_word_embeddings=True,
        ),
    ),
    # Not a real model: lets the benchmark commands run end to end on a CPU (tests).
    "tiny": (
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
    ),
}


def hf_config(shape: str) -> Any:
    """The transformers config of a named shape. No eos token: benchmarks ignore EOS."""
    from transformers import AutoConfig

    architecture, fields = SHAPES[shape]
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[architecture]
    return AutoConfig.for_model(
        model_type,
        architectures=[architecture],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        **fields,
    )


def build_random_model(shape: str, dtype: Any, device: Any) -> Any:
    """A transformers model of the shape with random weights, made directly on the device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            hf_config(shape), dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval()


def save_checkpoint(model: Any, directory: Path) -> Path:
    """Safetensors + a byte-level tokenizer, the layout the engine loads."""
    from kvfleet_engine.tiny_model import build_byte_tokenizer

    model.save_pretrained(directory)
    build_byte_tokenizer().save_pretrained(directory)
    return directory


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of weights one decode step reads: every matrix but the embedding table (whose rows
    are gathered), the LM head included (once, if tied to the embedding)."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    return total if tied else total - embedding.numel() * embedding.element_size()


def kv_bytes_per_token(shape: str, element_size: int = 2) -> int:
    _, fields = SHAPES[shape]
    return (
        2
        * fields["num_hidden_layers"]
        * fields["num_key_value_heads"]
        * fields["head_dim"]
        * element_size
    )
