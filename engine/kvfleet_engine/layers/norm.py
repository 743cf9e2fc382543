"""RMSNorm, computed in float32 like the reference implementations; optionally adds the residual
first (one fused Triton kernel on CUDA). A norm whose output feeds only a W8A8 fp8 linear
(`fp8_rows_out`, set by `quant.swap`) hands it the rows already quantized per token on CUDA,
at the sizes the product quantizes its input (`kernels.fp8_matmul.takes_fp8_rows`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fp8_rows_out = False  # the consumer is an fp8 linear (set from outside the model)

    def forward(self, x: torch.Tensor) -> Any:  # x: [..., dim] -> the same, or Fp8Rows
        if x.is_cuda:
            from kvfleet_engine.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, fp8_out=self._fp8_out(x))[0]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        if x.is_cuda:
            from kvfleet_engine.kernels.rms_norm import rms_norm

            out, summed = rms_norm(x, self.weight, self.eps, residual, self._fp8_out(x))
            assert summed is not None
            return out, summed
        summed = x + residual
        return self.forward(summed), summed

    def _fp8_out(self, x: torch.Tensor) -> bool:
        if not self.fp8_rows_out:
            return False
        from kvfleet_engine.kernels.fp8_matmul import takes_fp8_rows

        return takes_fp8_rows(x.numel() // x.shape[-1])
