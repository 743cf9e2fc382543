"""A checkpoint's config checked before anything is built: config.json's keys against the values
the model code can run (`check_hf_config`), and its sizes against the tensors the checkpoint
holds (`check_sizes`), so a hostile size field is a ValueError naming the file and the key, not
an allocation of terabytes or a loop over a billion layers. No torch."""

from __future__ import annotations

import math
import re
from typing import Any

from kvfleet_engine.config.checks import is_int, is_number

# config.json's keys the engine reads as counts: those it needs (>= 1), and those it may do
# without (absent, null or 0).
REQUIRED_COUNTS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
OPTIONAL_COUNTS = (
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "sliding_window",
)
# The model builds a rotary table of max_position_embeddings rows (Llama 4 Scout: 10M).
MAX_POSITIONS = 1 << 24
_SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
# Rope types layers/rotary.py implements. "frequency_factors": each frequency divided by a
# stored factor (how GGUF files keep Llama 3.1's scaling: the `rope_freqs` tensor).
ROPE_TYPES = ("default", "llama3", "frequency_factors")
_EMBEDDING = "model.embed_tokens.weight"
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")
# The fewest bits a safetensors checkpoint stores per layer weight (int4 packed: 4, with its
# scales more), with room to spare; GGUF files (down to 1.1 bits) are checked by their shapes.
_MIN_BITS_PER_WEIGHT = 2


def check_hf_config(hf_config: Any, source: str) -> None:
    """config.json (or the config a GGUF file's metadata makes, `source` naming it) is an object
    whose counts, switches and rope settings the model code can run; a ValueError naming the
    source and the key otherwise."""
    if not isinstance(hf_config, dict):
        raise ValueError(f"model: {source} must hold a JSON object, got {type(hf_config).__name__}")
    architectures = hf_config.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise ValueError(
            f"model: {source}: 'architectures' must be a list like [\"LlamaForCausalLM\"], got "
            f"{architectures!r}"
        )
    for key in REQUIRED_COUNTS:
        if key not in hf_config:
            raise ValueError(f"model: {source} has no {key!r}")
        _check_count(source, key, hf_config[key], 1)
    for key in OPTIONAL_COUNTS:
        if hf_config.get(key) is not None:
            _check_count(source, key, hf_config[key], 0)
    _check_heads(hf_config, source)
    max_positions = hf_config.get("max_position_embeddings") or 0
    if max_positions > MAX_POSITIONS:
        raise ValueError(
            f"model: {source}: 'max_position_embeddings' must be at most {MAX_POSITIONS}, got "
            f"{max_positions}"
        )
    eps: Any = hf_config.get("rms_norm_eps")
    if not (is_number(eps) and 0 < eps < 1):
        raise ValueError(f"model: {source}: 'rms_norm_eps' must be a number in (0, 1), got {eps!r}")
    for key in _SWITCHES:
        if hf_config.get(key) is not None and not isinstance(hf_config[key], bool):
            raise ValueError(
                f"model: {source}: {key!r} must be true or false, got {hf_config[key]!r}"
            )
    _check_rope(hf_config, source)
    eos_token_ids(hf_config.get("eos_token_id"), source, hf_config["vocab_size"])


def eos_token_ids(value: Any, source: str, vocab_size: int) -> frozenset[int]:
    """An `eos_token_id` value (an id, a list of ids or null) as a set of ids, each one of the
    vocabulary's (an id past it would never be sampled, so generation would never stop on it)."""
    ids = [value] if is_int(value) else value
    if ids is None:
        return frozenset()
    if not isinstance(ids, list) or not all(is_int(i) and i >= 0 for i in ids):
        raise ValueError(
            f"model: {source}: 'eos_token_id' must be a token id or a list of them, got {value!r}"
        )
    for token_id in ids:
        if token_id >= vocab_size:
            raise ValueError(
                f"model: {source}: 'eos_token_id' {token_id} is not a token id: 'vocab_size' is "
                f"{vocab_size}"
            )
    return frozenset(ids)


def check_sizes(
    hf_config: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    num_bytes: int | None,
    source: str,
) -> None:
    """The config's sizes against the checkpoint's tensors (Hugging Face name -> shape): its
    layers, its embedding, and no more layer weights than the tensors hold: than their
    `num_bytes` can hold (safetensors, whose packed quantized shapes are not the weights'), or,
    with None, than twice what the shapes count (GGUF, whose shapes are the weights' whatever
    their type). The bounds stop sizes that would allocate far more than the checkpoint holds;
    a tensor of the wrong shape, or a missing one, is named as the weights load.
    Runs before the model is built, which trusts the config's sizes."""
    layers = {int(match[1]) for name in shapes if (match := _LAYER_TENSOR.match(name))}
    num_layers = max(layers) + 1 if layers else 0
    if hf_config["num_hidden_layers"] != num_layers:
        raise ValueError(
            f"model: {source}: 'num_hidden_layers' is {hf_config['num_hidden_layers']}, but the "
            f"checkpoint's tensors hold {num_layers} layers"
        )
    expected = (hf_config["vocab_size"], hf_config["hidden_size"])
    embedding = shapes.get(_EMBEDDING)
    if embedding is None:
        raise ValueError(f"model: {source}: the checkpoint has no tensor {_EMBEDDING}")
    if tuple(embedding) != expected:
        raise ValueError(
            f"model: {source}: 'vocab_size' and 'hidden_size' are {list(expected)}, but the "
            f"checkpoint's {_EMBEDDING} has shape {list(embedding)}"
        )
    num_weights = num_layers * _layer_weights(hf_config)
    if num_bytes is None:  # twice: a missing tensor is the loader's to name, not a size here
        held = sum(math.prod(shape) for name, shape in shapes.items() if _LAYER_TENSOR.match(name))
        too_many, limit = num_weights > 2 * held, f"twice the checkpoint's {held} layer weights"
    else:
        too_many = num_weights * _MIN_BITS_PER_WEIGHT > 8 * num_bytes
        limit = f"the checkpoint's {num_bytes} bytes of tensors can hold"
    if too_many:
        raise ValueError(
            f"model: {source}: its sizes (hidden_size, intermediate_size, num_attention_heads, "
            f"num_key_value_heads, head_dim) make {num_weights} layer weights, more than {limit}"
        )


def _check_count(source: str, key: str, value: Any, low: int) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"model: {source}: {key!r} must be an integer >= {low}, got {value!r}")


def _check_heads(hf_config: dict[str, Any], source: str) -> None:
    """KV heads divide the query heads; each head's size is even (rotary pairs) and, unless
    head_dim says it, hidden_size / num_attention_heads."""
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(
            f"model: {source}: 'num_key_value_heads' ({kv_heads}) must divide "
            f"'num_attention_heads' ({heads})"
        )
    head_dim = hf_config.get("head_dim")
    if not head_dim and hf_config["hidden_size"] % heads:
        raise ValueError(
            f"model: {source}: 'hidden_size' ({hf_config['hidden_size']}) must be a multiple of "
            f"'num_attention_heads' ({heads}) unless 'head_dim' is given"
        )
    head_dim = head_dim or hf_config["hidden_size"] // heads
    if head_dim % 2:
        raise ValueError(f"model: {source}: the head size {head_dim} must be even (rotary pairs)")


def _check_rope(hf_config: dict[str, Any], source: str) -> None:
    for key in ("rope_parameters", "rope_scaling"):
        params = hf_config.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"model: {source}: {key!r} must be an object or null, got {params!r}")
        rope_type = rope_type_of(params)
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"model: {source}: {key}: rope type {rope_type!r} is not supported; supported: "
                f"{', '.join(ROPE_TYPES)}"
            )
        if rope_type == "llama3":
            for name in _LLAMA3_ROPE_KEYS:
                if not is_number(params.get(name)) or params[name] <= 0:
                    raise ValueError(
                        f"model: {source}: {key}.{name} must be a number > 0 for llama3 rope "
                        f"scaling, got {params.get(name)!r}"
                    )
            if params["low_freq_factor"] == params["high_freq_factor"]:
                raise ValueError(
                    f"model: {source}: {key}: low_freq_factor and high_freq_factor must differ"
                )
        theta = params.get("rope_theta")
        if theta is not None and (not is_number(theta) or theta <= 0):
            raise ValueError(
                f"model: {source}: {key}.rope_theta must be a number > 0, got {theta!r}"
            )
    theta = hf_config.get("rope_theta")
    if theta is not None and (not is_number(theta) or theta <= 0):
        raise ValueError(f"model: {source}: 'rope_theta' must be a number > 0, got {theta!r}")


def rope_type_of(params: dict[str, Any]) -> Any:
    """A rope_parameters / rope_scaling object's type: `rope_type`, or the older `type`."""
    return params.get("rope_type") or params.get("type") or "default"


def _layer_weights(hf_config: dict[str, Any]) -> int:
    """Weights of one decoder layer's linears: q, k, v, o and the gated MLP."""
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    inner = hf_config.get("intermediate_size") or 0
    return hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inner
