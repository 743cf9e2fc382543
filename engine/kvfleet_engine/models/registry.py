"""Which Hugging Face architectures the engine runs, without importing torch."""

from __future__ import annotations

import importlib
from typing import Any

# Hugging Face `architectures[0]` -> "module:class" of our implementation.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "kvfleet_engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvfleet_engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kvfleet_engine.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "kvfleet_engine.models.llama:LlamaForCausalLM",
}


def check_architecture(name: str) -> None:
    if name not in ARCHITECTURES:
        raise ValueError(
            f"unknown architecture {name!r} in config.json; supported: {', '.join(ARCHITECTURES)}"
        )


def model_class(name: str) -> Any:
    check_architecture(name)
    module_name, class_name = ARCHITECTURES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
