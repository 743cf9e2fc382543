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


def weight_bytes_per_step(model: Any, quantization: str = "none", group_size: int = 128) -> int:
    """Bytes of weights one decode step reads: every matrix but the embedding table (whose rows
    are gathered), the LM head included (once, if tied to the embedding). Quantized, each
    decoder-layer matrix [N, K] counts its packed form: fp8 / int8 N·K bytes + a float32 scale
    per output channel; int4 (awq, gptq) N·K / 2 bytes + float16 scales and offsets per group."""
    params = {id(p): (name, p) for name, p in model.named_parameters()}
    total = 0
    for name, p in params.values():
        quantized = quantization != "none" and ".layers." in name and p.dim() == 2
        total += (
            _quantized_bytes(p.shape, quantization, group_size)
            if quantized
            else (p.numel() * p.element_size())
        )
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    return total if tied else total - embedding.numel() * embedding.element_size()


def _quantized_bytes(shape: Any, quantization: str, group_size: int) -> int:
    out_features, in_features = shape
    if quantization in ("fp8", "int8"):
        return out_features * in_features + 4 * out_features
    if quantization in ("awq", "gptq"):
        return out_features * in_features // 2 + 2 * 2 * out_features * in_features // group_size
    raise ValueError(f"quantization must be none | fp8 | int8 | awq | gptq, got {quantization!r}")


def matmul_weights_per_token(model: Any) -> int:
    """Multiply-adds per token in the weight matrices (what a decode step reads, in weights)."""
    return weight_bytes_per_step(model) // next(model.parameters()).element_size()


def save_random_int4_checkpoint(
    model: Any, directory: Path, method: str, group_size: int = 128, seed: int = 0
) -> Path:
    """The model's embeddings, norms and LM head with every decoder-layer matrix replaced by
    random int4 tensors in the AutoAWQ GEMM (`awq`, zero points random) or GPTQ (`gptq`, v1,
    symmetric, no act-order) layout: random codes, and scales drawn so that the dequantized
    weights have about the spread of the float ones (std 0.02) — a random int4 model."""
    import json

    import torch
    from safetensors.torch import save_file

    from kvfleet_engine.tiny_model import build_byte_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(model.device).manual_seed(seed)
    tensors: dict[str, Any] = {}
    for name, param in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if ".layers." in name and leaf == "weight" and param.dim() == 2:
            out_features, in_features = param.shape
            tensors.update(
                _random_int4(module, in_features, out_features, method, group_size, generator)
            )
        else:
            tensors[name] = param.detach().cpu().contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        }
        if method == "awq"
        else {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    build_byte_tokenizer().save_pretrained(directory)
    return directory


def _random_int4(
    module: str, in_features: int, out_features: int, method: str, group_size: int, generator: Any
) -> dict[str, Any]:
    import torch

    device, groups = generator.device, in_features // group_size

    def words(*shape: int) -> Any:  # every int32 is 8 valid nibbles
        return torch.randint(
            -(2**31), 2**31 - 1, shape, dtype=torch.int32, device=device, generator=generator
        ).cpu()

    # uniform codes minus a zero point of about 7.5 have std ~4.6: scales of ~0.02 / 4.6
    scales = 0.0035 + 0.001 * torch.rand(groups, out_features, device=device, generator=generator)
    if method == "awq":
        tensors = {
            "qweight": words(in_features, out_features // 8),
            "qzeros": words(groups, out_features // 8),
        }
    elif method == "gptq":
        tensors = {
            "qweight": words(in_features // 8, out_features),
            # zero 8 stored as 7 (v1) in every nibble
            "qzeros": torch.full((groups, out_features // 8), 0x77777777, dtype=torch.int32),
            "g_idx": torch.arange(in_features, dtype=torch.int32) // group_size,
        }
    else:
        raise ValueError(f"random int4 checkpoints are awq or gptq, not {method!r}")
    tensors["scales"] = scales.half().cpu()
    return {f"{module}.{name}": tensor for name, tensor in tensors.items()}


def kv_bytes_per_token(shape: str, element_size: int = 2) -> int:
    _, fields = SHAPES[shape]
    return (
        2
        * fields["num_hidden_layers"]
        * fields["num_key_value_heads"]
        * fields["head_dim"]
        * element_size
    )
