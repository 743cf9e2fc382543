"""The model's settings, read from its checkpoint: a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_engine.config.checks import check, is_int
from kvfleet_engine.loaders.gguf_metadata import find_gguf_file, gguf_eos_token_ids, gguf_hf_config
from kvfleet_engine.loaders.gguf_names import gguf_linear_types
from kvfleet_engine.models.registry import check_architecture
from kvfleet_engine.quant.config import (
    QuantConfig,
    resolve_gguf_quantization,
    resolve_quantization,
)

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


@dataclass(frozen=True)
class ModelConfig:
    # A Hugging Face directory (config.json, *.safetensors, tokenizer files) or a GGUF file.
    path: str
    # "safetensors" | "gguf": where the config, tokenizer and tensors come from.
    format: str
    # Hugging Face architecture name, e.g. "LlamaForCausalLM".
    architecture: str
    # Weight and activation dtype: float32 | bfloat16 | float16; "auto" only for a GGUF file
    # (quantized tensors: the runner picks float32 on the CPU, bfloat16 on a GPU).
    dtype: str
    # Longest sequence (prompt + generated tokens) the engine accepts.
    max_model_len: int
    # Token ids that end generation (config.json / generation_config.json / GGUF metadata).
    eos_token_ids: frozenset[int]
    # The model's config in config.json's keys (parsed, or built from the GGUF metadata).
    hf_config: dict[str, Any] = field(repr=False, compare=False)
    # Quantized weights: the `quantization` setting checked against the checkpoint's
    # quantization_config (None: plain weights in `dtype`).
    quantization: QuantConfig | None = None

    @classmethod
    def from_pretrained(
        cls, path: str, *, dtype: str, max_model_len: int | None, quantization: str | None
    ) -> ModelConfig:
        """Read the checkpoint's config; the settings' defaults are EngineConfig.create's."""
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            hf_config = gguf_hf_config(str(gguf_file))
            return cls(
                path=str(gguf_file),
                format="gguf",
                architecture=hf_config["architectures"][0],
                dtype=_resolve_dtype(dtype, None),  # "auto" stays: the runner picks by device
                max_model_len=_resolve_max_model_len(max_model_len, hf_config),
                eos_token_ids=gguf_eos_token_ids(str(gguf_file)),
                hf_config=hf_config,
                quantization=resolve_gguf_quantization(
                    quantization, gguf_linear_types(str(gguf_file)), gguf_file.name
                ),
            )
        directory = Path(path)
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise ValueError(
                f"model: {path!r} is neither a model directory (no config.json) nor a GGUF file"
            )
        hf_config = _read_json(config_file)
        _check_hf_config(hf_config, config_file)
        architectures = hf_config.get("architectures") or [None]
        check_architecture(architectures[0])
        return cls(
            path=str(directory),
            format="safetensors",
            architecture=architectures[0],
            dtype=_resolve_dtype(dtype, hf_config),
            max_model_len=_resolve_max_model_len(max_model_len, hf_config),
            eos_token_ids=_eos_token_ids(directory, hf_config),
            hf_config=hf_config,
            quantization=resolve_quantization(quantization, hf_config),
        )

    @property
    def quantization_name(self) -> str:
        """The quantization method ("none" for plain weights), as metrics label it."""
        return "none" if self.quantization is None else self.quantization.method

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(
            self.hf_config.get("num_key_value_heads") or self.hf_config["num_attention_heads"]
        )

    @property
    def head_dim(self) -> int:
        head_dim = self.hf_config.get("head_dim")
        if head_dim:
            return int(head_dim)
        return int(self.hf_config["hidden_size"]) // int(self.hf_config["num_attention_heads"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])


# config.json's keys the engine reads as counts: those it needs (>= 1), and those it may do
# without (absent, null or 0).
_REQUIRED_COUNTS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
_OPTIONAL_COUNTS = (
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "sliding_window",
)


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: {file} is not valid JSON: {exc}") from None


def _check_hf_config(hf_config: Any, file: Path) -> None:
    """config.json is an object whose counts are positive integers; ValueError naming the file
    and the key otherwise."""
    if not isinstance(hf_config, dict):
        raise ValueError(f"model: {file} must hold a JSON object, got {type(hf_config).__name__}")
    for key in _REQUIRED_COUNTS:
        if key not in hf_config:
            raise ValueError(f"model: {file} has no {key!r}")
        _check_count(file, key, hf_config[key], 1)
    for key in _OPTIONAL_COUNTS:
        if hf_config.get(key) is not None:
            _check_count(file, key, hf_config[key], 0)


def _check_count(file: Path, key: str, value: Any, low: int) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"model: {file}: {key!r} must be an integer >= {low}, got {value!r}")


def _resolve_dtype(dtype: str, hf_config: dict[str, Any] | None) -> str:
    """The dtype setting, with `auto` replaced by the checkpoint's dtype (hf_config None: a GGUF
    file, whose quantized tensors have none)."""
    check(isinstance(dtype, str), "dtype", dtype, " | ".join(DTYPES))
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    check(dtype in DTYPES, "dtype", dtype, " | ".join(DTYPES))
    if dtype != "auto" or hf_config is None:
        return dtype
    saved = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return (
        _DTYPE_ALIASES.get(saved, saved) if saved in DTYPES + tuple(_DTYPE_ALIASES) else "float32"
    )


def _resolve_max_model_len(requested: int | None, hf_config: dict[str, Any]) -> int:
    limit = int(hf_config.get("max_position_embeddings") or 2048)
    window = int(hf_config.get("sliding_window") or 0)
    if window and hf_config.get("use_sliding_window", True) and window < limit:
        # We compute full attention, which equals sliding-window attention up to the window.
        log.info("capping max_model_len at the sliding window (%d tokens)", window)
        limit = window
    if requested is None:
        return limit
    check(
        is_int(requested) and 1 < requested <= limit,
        "max_model_len",
        requested,
        f"in [2, {limit}] (the model's maximum length)",
    )
    return requested


def _eos_token_ids(directory: Path, hf_config: dict[str, Any]) -> frozenset[int]:
    value = hf_config.get("eos_token_id")
    generation_file = directory / "generation_config.json"
    if generation_file.is_file():
        generation = _read_json(generation_file)
        if isinstance(generation, dict):
            value = generation.get("eos_token_id", value)
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)
