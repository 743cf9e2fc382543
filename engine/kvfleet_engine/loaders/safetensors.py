"""A Hugging Face checkpoint directory's tensors: *.safetensors files, sharded or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
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
        with safe_open(str(file), framework="pt", device=read_device) as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" not in name:
                    yield name, f.get_tensor(name)
