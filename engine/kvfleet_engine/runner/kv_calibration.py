"""The file behind `kv_cache_calibration`: each attention layer's query moment, which an fp8
cache's K rounding is shaped by (`layers.kv_shaping`). Written by
`python -m kvfleet_engine.bench.calibrate_kv`, read at start-up and bound to the layers.

A safetensors file: `layers.{i}.k_moment` [num_kv_heads, head_dim, head_dim] float32 for each
attention layer i (model order), each over its trace (the stores use it factored:
`kv_shaping.factor`); metadata `format` (FORMAT), `version`, `num_layers`, `num_kv_heads`,
`head_dim`, `tokens` (how many calibration tokens it saw), `model`
(its file or directory name, for people)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvfleet_engine.layers import kv_shaping
from kvfleet_engine.layers.attention import Attention

FORMAT = "kvfleet-kv-calibration"
VERSION = "1"


def tensor_name(layer: int) -> str:
    return f"layers.{layer}.k_moment"


def save(path: Path, moments: list[torch.Tensor], model: str, tokens: int) -> None:
    """Write `moments` (one [kv heads, dim, dim] sum of q q^T per layer), each over its trace."""
    from safetensors.torch import save_file

    normalised = {}
    for i, moment in enumerate(moments):
        trace = torch.diagonal(moment, dim1=-2, dim2=-1).sum(-1).clamp(min=1e-30)
        normalised[tensor_name(i)] = (moment / trace[:, None, None]).float().cpu().contiguous()
    num_kv_heads, head_dim, _ = moments[0].shape
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "num_layers": str(len(moments)),
        "num_kv_heads": str(num_kv_heads),
        "head_dim": str(head_dim),
        "tokens": str(tokens),
        "model": model,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(normalised, str(path), metadata=metadata)


def load(path: str) -> tuple[list[torch.Tensor], dict[str, str]]:
    """The file's moments in layer order and its metadata; ValueError naming the file when it
    is not one `save` wrote."""
    from safetensors import SafetensorError, safe_open

    where = f"kv_cache_calibration {path!r}"
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ValueError(f"{where}: not a KV calibration file (no format={FORMAT})")
            if metadata.get("version") != VERSION:
                raise ValueError(f"{where}: version {metadata.get('version')}, not {VERSION}")
            names = [tensor_name(i) for i in range(int(metadata["num_layers"]))]
            missing = sorted(set(names) - set(handle.keys()))
            if missing:
                raise ValueError(f"{where}: lacks {missing[:3]}")
            return [handle.get_tensor(name) for name in names], metadata
    except (OSError, SafetensorError) as error:
        raise ValueError(f"{where}: {error}") from error


def bind_moments(
    layers: list[Attention],
    path: str,
    device: torch.device,
    num_layers: int,
    first_layer: int = 0,
    tp: tuple[int, int] = (0, 1),
) -> None:
    """Give each of this rank's attention layers its moment (`Attention.shape_k_by`).
    `num_layers`: the model's; `first_layer`: the one this rank's first is (a pipeline stage's
    start); `tp`: this rank's (index, count) of the tensor-parallel split, whose kv heads it
    keeps (or the one it holds, with fewer kv heads than ranks: `parallel.tensor`)."""
    moments, metadata = load(path)
    where = f"kv_cache_calibration {path!r} (calibrated on {metadata.get('model', '?')})"
    if len(moments) != num_layers:
        raise ValueError(f"{where}: {len(moments)} layers, the model has {num_layers}")
    rank, size = tp
    for i, layer in enumerate(layers, start=first_layer):
        moment = moments[i]
        kv_parts = min(size, moment.shape[0])
        index = rank // (size // kv_parts)
        local = moment[index * layer.num_kv_heads : (index + 1) * layer.num_kv_heads]
        want = (layer.num_kv_heads * kv_parts, layer.head_dim, layer.head_dim)
        if tuple(moment.shape) != want:
            raise ValueError(
                f"{where}: layer {i} is {list(moment.shape)}, the model's {list(want)}"
            )
        layer.shape_k_by(kv_shaping.factor(local).to(device))
