"""Session fixture: quantized copies of the tiny checkpoints (see quant_checkpoints), each
written once per test session on first use.

    def test_x(quantized_checkpoints):
        path = quantized_checkpoints.path("llama3", "gptq-w4a16")
        ref = quantized_checkpoints.reference("llama3", "gptq-w4a16")  # transformers, float32
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from quant_checkpoints import (
    SCHEMES,
    autoawq_reference_model,
    reference_model,
    write_autoawq,
    write_quantized,
)

AUTOAWQ = "autoawq-gemm"  # AutoAWQ's own tool and layout, beside the llmcompressor SCHEMES


class QuantizedCheckpoints:
    """Quantized tiny checkpoints by (architecture, scheme) and their transformers references."""

    def __init__(self, root: Path, checkpoints: Any) -> None:
        self.root = root
        self.checkpoints = checkpoints  # conftest.Checkpoints: the unquantized sources
        self.paths: dict[tuple[str, str], Path] = {}
        self.references: dict[tuple[str, str], Any] = {}

    def path(self, architecture: str, scheme: str) -> Path:
        """The checkpoint directory: a scheme of SCHEMES (llmcompressor, compressed-tensors,
        group size 32) or "autoawq-gemm" (AutoAWQ, about a minute: mark such tests slow)."""
        key = (architecture, scheme)
        if key not in self.paths:
            if scheme != AUTOAWQ and scheme not in SCHEMES:
                raise ValueError(f"scheme must be one of {[*SCHEMES, AUTOAWQ]}, got {scheme!r}")
            source = self.checkpoints.path(architecture)
            destination = self.root / f"{architecture}-{scheme}"
            if scheme == AUTOAWQ:
                write_autoawq(source, destination)
            else:
                write_quantized(source, destination, scheme)
            self.paths[key] = destination
        return self.paths[key]

    def reference(self, architecture: str, scheme: str) -> Any:
        """transformers' float32 model of the checkpoint with its weights dequantized."""
        key = (architecture, scheme)
        if key not in self.references:
            path = self.path(architecture, scheme)
            load = autoawq_reference_model if scheme == AUTOAWQ else reference_model
            self.references[key] = load(path)
        return self.references[key]


@pytest.fixture(scope="session")
def quantized_checkpoints(
    checkpoints: Any, tmp_path_factory: pytest.TempPathFactory
) -> QuantizedCheckpoints:
    return QuantizedCheckpoints(tmp_path_factory.mktemp("quantized"), checkpoints)
