"""Build a model on the meta device, materialise it on the target device, load safetensors."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from kvfleet_engine.config import ModelConfig
from kvfleet_engine.layers.attention import AttentionMetadata
from kvfleet_engine.layers.linear import Linear
from kvfleet_engine.models.registry import model_class

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CausalLM(Protocol):
    """What the runner needs from a model module."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [rows, vocab]

    def modules(self) -> Iterator[nn.Module]: ...


def load_model(config: ModelConfig, device: torch.device) -> CausalLM:
    cls = model_class(config.architecture)
    dtype = DTYPES[config.dtype]
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config.hf_config, config.architecture)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=device)
    if getattr(model, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties parameters
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset()
    load_weights(model, Path(config.path))
    model.eval()
    return model


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {directory}")
    return files


@torch.no_grad()
def load_weights(model: nn.Module, directory: Path) -> None:
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    read_device = str(device) if device.type == "cuda" else "cpu"  # straight to the GPU
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    modules = dict(model.named_modules())
    unloaded = set(params)
    for file in checkpoint_files(directory):
        with safe_open(str(file), framework="pt", device=read_device) as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                target, shard = name, None
                for part, (fused, shard_name) in packed.items():
                    if f".{part}." in name:
                        target, shard = name.replace(f".{part}.", f".{fused}."), shard_name
                        break
                param = params.get(target)
                if param is None:
                    if name == "lm_head.weight" and "lm_head.weight" not in params:
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                module = modules[target.rsplit(".", 1)[0]]
                loader = module.load_shard if isinstance(module, Linear) else None
                tensor = f.get_tensor(name)
                try:
                    if loader is not None:
                        loader(param, tensor, shard)
                    elif param.shape != tensor.shape:
                        raise ValueError(f"shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                    else:
                        param.copy_(tensor)
                except ValueError as error:
                    raise ValueError(f"checkpoint tensor {name!r}: {error}") from error
                unloaded.discard(target)
    if getattr(model, "tie_word_embeddings", False):
        unloaded.discard("lm_head.weight")
    if unloaded:
        raise ValueError(f"checkpoint in {directory} lacks weights for: {sorted(unloaded)[:5]}")
