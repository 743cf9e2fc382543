"""The model's tokenizer: from the Hugging Face directory, or built from the GGUF metadata."""

from __future__ import annotations

from typing import Any

from kvfleet_engine.config import ModelConfig


def load_tokenizer(model: ModelConfig) -> Any:
    if model.format == "gguf":
        from kvfleet_engine.loaders.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(model.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.path)
