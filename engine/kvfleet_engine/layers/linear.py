"""Linear layers whose weights load from checkpoint shards: separate q/k/v (or gate/up)
checkpoint tensors fill one fused parameter, so each step runs one matmul instead of three."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

# On the CPU, MKL multiplies a few rows (a decode batch) much faster as W · xᵀ than as x · Wᵀ,
# F.linear's layout: 2 rows 2.8x, 8 rows 1.75x, 16 rows 1.3x faster for SmolLM2's matrices on
# 2 AVX2 cores (float32, same run). One row is a matrix-vector product either way (and bit for bit
# the same), so it keeps F.linear.
_CPU_FEW_ROWS = 16
# A wide layer's single row (the LM head's logits at batch-1 decode, the step's largest product)
# is 1.7x faster against [in, out] than against [out, in] (SmolLM2's 576 x 49,152 float32 head:
# 9.8 against 17.1 ms on 2 AVX2 cores); narrower layers gain nothing, so they keep one copy.
_CPU_ONE_ROW_MIN_OUT = 16384

# (parameter name, checkpoint tensor, shard) -> the part of the tensor this layer holds: tensor
# parallelism sets one on the layers it splits (parallel/tensor.py).
CheckpointSlicer = Callable[[str, torch.Tensor, str | None], torch.Tensor]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate | up] [rows, 2 * inner] -> [rows, inner]: one Triton
    kernel on CUDA, eager torch elsewhere (both round as eager torch does)."""
    if gate_up.is_cuda:
        from kvfleet_engine.kernels.activation import silu_and_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.checkpoint_slicer: CheckpointSlicer | None = None
        # [in_features, out_features]: a second copy for one-row products on the CPU (set by
        # finish_loading for wide float32 layers, None elsewhere).
        self.one_row_weight: torch.Tensor | None = None
        self.attach_weight_loaders()

    def attach_weight_loaders(self) -> None:
        """Give each parameter its loader (again after to_empty, which makes new parameters)."""
        for name, param in self.named_parameters(recurse=False):
            param.weight_loader = partial(self._load_named, name)  # type: ignore[attr-defined]

    def _load_named(
        self, name: str, param: torch.Tensor, loaded: torch.Tensor, shard: str | None
    ) -> None:
        if self.checkpoint_slicer is not None:
            loaded = self.checkpoint_slicer(name, loaded, shard)
        self.load_shard(param, loaded, shard)

    def finish_loading(self) -> None:
        """Keep a wide float32 layer on the CPU also as [in, out] for one-row products (costs
        its size again in memory). Runs after the weights are loaded, on each rank's own part
        under tensor parallelism, so a split layer keeps the copy of its own rows."""
        weight = self.weight
        if (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and weight.shape[0] >= _CPU_ONE_ROW_MIN_OUT
        ):
            self.one_row_weight = weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor, silu_gated: bool = False) -> torch.Tensor:
        """x [rows, in_features] @ weightᵀ (+ bias); with silu_gated, x is a gated MLP's
        [gate | up] [rows, 2 * in_features] and the product takes silu(gate) * up."""
        if silu_gated:
            x = silu_and_mul(x)
        if self.one_row_weight is not None and x.dim() == 2 and x.shape[0] == 1:
            out = torch.mm(x, self.one_row_weight)  # [1, out_features]
            return out if self.bias is None else out + self.bias
        if x.device.type == "cpu" and x.dim() == 2 and 1 < x.shape[0] <= _CPU_FEW_ROWS:
            out = torch.mm(self.weight, x.t()).t().contiguous()  # [rows, out_features]
            return out if self.bias is None else out + self.bias
        if x.is_cuda and self.bias is None:
            from kvfleet_engine.kernels import tma_gemm

            blocks = tma_gemm.planned_blocks(x, self.weight)
            if blocks is not None:  # a plan file lists this shape (kernels/tma_gemm.py)
                return tma_gemm.tma_gemm(x, self.weight, blocks)
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
