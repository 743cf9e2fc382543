"""kvfleet engine: paged-KV, continuous-batching LLM inference.

`from kvfleet_engine import LLM, SamplingParams` — the names are imported lazily, so importing
the package does not import torch."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# cuBLAS without a workspace never splits K into a second, reduce kernel. On the H200 that makes
# one-token products 2.5% faster (batch-1 decode step 4.57 -> 4.43 ms) and 64-token ones 5.6%,
# and leaves prompt-sized ones as they were (`python -m kvfleet_engine.bench.gemv`, results in
# bench/results/*-gemv-variants.json). PyTorch reads the variable once, when it first makes a
# cuBLAS handle, so it is set when the package is imported; a value already set wins. The cuBLASLt
# workspace (products with a bias) goes to 0 with it: PyTorch caps it at the cuBLAS one anyway, and
# warns when the requested size is larger.
if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":0:0"
    os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "0")

if TYPE_CHECKING:
    from kvfleet_engine.config import EngineConfig
    from kvfleet_engine.engine import LLMEngine
    from kvfleet_engine.llm import LLM
    from kvfleet_engine.outputs import CompletionOutput, RequestOutput
    from kvfleet_engine.sampling import SamplingParams

_EXPORTS = {
    "LLM": "kvfleet_engine.llm",
    "LLMEngine": "kvfleet_engine.engine",
    "EngineConfig": "kvfleet_engine.config",
    "SamplingParams": "kvfleet_engine.sampling",
    "RequestOutput": "kvfleet_engine.outputs",
    "CompletionOutput": "kvfleet_engine.outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfleet_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
