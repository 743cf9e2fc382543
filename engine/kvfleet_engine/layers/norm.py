"""RMSNorm, computed in float32 like the reference implementations; optionally adds the residual
first (one fused Triton kernel on CUDA)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        if x.is_cuda:
            from kvfleet_engine.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        if x.is_cuda:
            from kvfleet_engine.kernels.rms_norm import rms_norm

            out, summed = rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return out, summed
        summed = x + residual
        return self.forward(summed), summed
