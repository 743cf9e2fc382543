"""A Hugging Face checkpoint directory's tensors: *.safetensors files, sharded or not (the files
and their headers: safetensors_header.py, checked when the config is read)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvfleet_engine.loaders.safetensors_header import checkpoint_files


def safetensors_tensors(
    directory: Path, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, read straight to the GPU when the model lives there."""
    read_device = str(device) if device.type == "cuda" else "cpu"
    for file in checkpoint_files(directory):
        with _open(file, read_device) as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" not in name:
                    yield name, _get_tensor(f, file, name)


def _open(file: Path, device: str) -> Any:
    """safe_open, with a corrupt or missing file named in a ValueError."""
    try:
        return safe_open(str(file), framework="pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"model: {file} is not a readable safetensors file: {exc}") from None


def _get_tensor(f: Any, file: Path, name: str) -> torch.Tensor:
    try:
        tensor: torch.Tensor = f.get_tensor(name)
    except (SafetensorError, OSError, TypeError) as exc:
        raise ValueError(f"model: {file}: tensor {name!r} cannot be read: {exc}") from None
    return tensor
