"""A Hugging Face checkpoint directory's tensors: *.safetensors files, sharded or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / name for name in sorted(set(_weight_map(index).values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {directory}")
    return files


def safetensors_tensors(
    directory: Path, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, read straight to the GPU when the model lives there."""
    read_device = str(device) if device.type == "cuda" else "cpu"
    for file in checkpoint_files(directory):
        with _open(file, read_device) as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" not in name:
                    yield name, f.get_tensor(name)


def _open(file: Path, device: str) -> Any:
    """safe_open, with a corrupt or missing file named in a ValueError."""
    try:
        return safe_open(str(file), framework="pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"model: {file} is not a readable safetensors file: {exc}") from None


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"model: {index} has no readable weight_map: {exc!r}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"model: {index}: weight_map must be a JSON object")
    return weight_map
