"""Linear layers whose weights load from checkpoint shards: separate q/k/v (or gate/up)
checkpoint tensors fill one fused parameter, so each step runs one matmul instead of three."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_offsets(self) -> dict[str, tuple[int, int]]:
        """Checkpoint shard name -> (row offset, rows) inside the fused weight."""
        return {}

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None) -> None:
        if shard is None:
            if param.shape != loaded.shape:
                raise ValueError(f"shape {tuple(loaded.shape)} != expected {tuple(param.shape)}")
            param.data.copy_(loaded)
            return
        offset, rows = self.shard_offsets()[shard]
        expected = (rows, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shard {shard!r} has shape {tuple(loaded.shape)}, expected {expected}"
            )
        param.data[offset : offset + rows].copy_(loaded)


class MergedLinear(Linear):
    """Several checkpoint linears with the same input, stacked along the output dim."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self._offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, rows in shards.items():
            self._offsets[name] = (offset, rows)
            offset += rows

    def shard_offsets(self) -> dict[str, tuple[int, int]]:
        return self._offsets
