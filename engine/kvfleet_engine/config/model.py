"""The model's settings, read from its checkpoint: a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_engine.config.checks import check, is_int
from kvfleet_engine.config.model_checks import check_hf_config, check_sizes, eos_token_ids
from kvfleet_engine.loaders.gguf_metadata import find_gguf_file, gguf_eos_token_ids, gguf_hf_config
from kvfleet_engine.loaders.gguf_names import gguf_linear_types, gguf_tensor_shapes
from kvfleet_engine.loaders.safetensors_header import FLOAT_DTYPES, checkpoint_headers
from kvfleet_engine.models.registry import check_architecture
from kvfleet_engine.quant.config import (
    QuantConfig,
    resolve_gguf_quantization,
    resolve_quantization,
)

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The dtypes config.json's `dtype` (older: `torch_dtype`) may name, aliases aside; `dtype="auto"`
# serves the checkpoint in it (float64: in float32).
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16", "float64")
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
            check_hf_config(hf_config, str(gguf_file))
            shapes = gguf_tensor_shapes(str(gguf_file))
            check_sizes(hf_config, shapes, None, str(gguf_file))
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
        check_hf_config(hf_config, str(config_file))
        check_architecture(hf_config["architectures"][0])
        _check_safetensors_sizes(hf_config, directory, str(config_file))
        return cls(
            path=str(directory),
            format="safetensors",
            architecture=hf_config["architectures"][0],
            dtype=_resolve_dtype(dtype, hf_config, str(config_file)),
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


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: {file} is not valid JSON: {exc}") from None


def _check_safetensors_sizes(hf_config: dict[str, Any], directory: Path, source: str) -> None:
    """config.json's sizes against the tensors' headers; a checkpoint without quantization_config
    holds float tensors only (an int8 tensor would load as its codes)."""
    headers = checkpoint_headers(directory)
    if hf_config.get("quantization_config") is None:
        for name, header in headers.items():
            if header.dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"model: {header.file}: tensor {name!r} has dtype {header.dtype}, but "
                    f"{source} has no quantization_config; plain weights are "
                    f"{', '.join(sorted(FLOAT_DTYPES))}"
                )
    shapes = {name: header.shape for name, header in headers.items()}
    check_sizes(hf_config, shapes, sum(h.num_bytes for h in headers.values()), source)


def _resolve_dtype(dtype: str, hf_config: dict[str, Any] | None, source: str = "") -> str:
    """The dtype setting, with `auto` replaced by the checkpoint's dtype (hf_config None: a GGUF
    file, whose quantized tensors have none); config.json's `dtype` (older: `torch_dtype`) is
    read, and so checked, only then."""
    check(isinstance(dtype, str), "dtype", dtype, " | ".join(DTYPES))
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    check(dtype in DTYPES, "dtype", dtype, " | ".join(DTYPES))
    if dtype != "auto" or hf_config is None:
        return dtype
    for key in ("dtype", "torch_dtype"):
        saved = hf_config.get(key)
        if saved is None:
            continue
        served = _DTYPE_ALIASES.get(saved, saved) if isinstance(saved, str) else saved
        if served not in CHECKPOINT_DTYPES:
            raise ValueError(
                f"model: {source}: {key!r} must be one of {', '.join(CHECKPOINT_DTYPES)} or null, "
                f"got {saved!r} (dtype auto serves the checkpoint's; set dtype to serve another)"
            )
        return "float32" if served == "float64" else str(served)
    return "float32"


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
    """generation_config.json's eos_token_id, else config.json's."""
    generation_file = directory / "generation_config.json"
    if generation_file.is_file():
        generation = _read_json(generation_file)
        if isinstance(generation, dict) and "eos_token_id" in generation:
            return eos_token_ids(
                generation["eos_token_id"], str(generation_file), hf_config["vocab_size"]
            )
    return eos_token_ids(
        hf_config.get("eos_token_id"), str(directory / "config.json"), hf_config["vocab_size"]
    )
