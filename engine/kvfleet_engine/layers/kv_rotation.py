"""A quantized cache (fp8 or int8) stores K rotated: after RoPE, each head's query and key rows are
multiplied by the normalised Hadamard matrix H of order head_dim (orthonormal, so
(qH) · (kH) = q · k: the scores, and so the attention, are unchanged in exact arithmetic). e4m3
rounds each element by up to 1/16 of itself; the score's error Σ q_i k_i ε_i is largest where a
few channels carry most of q and k (RoPE's low frequencies do), and H spreads them over all
channels. On SmolLM2 the fp8 cache's perplexity gap falls from +1.26% to +0.28% (bench/NOTES.md
section 15). The rotated rows are also close to Gaussian with no outlier channel, which is what
integer codes on an even grid want: an int8 K rotated costs nothing measurable (section 16). V is
stored as it is (its error enters linearly; rotating it gained nothing measurable).

Head sizes that are not a power of two have no Sylvester matrix: their quantized cache is not
rotated. Every backend follows the rule here (the Triton kernels rotate in registers,
`kernels.hadamard`); the reference below is what they are tested against."""

from __future__ import annotations

import functools

import torch


def rotates(head_dim: int, quantized_cache: bool) -> bool:
    """Whether a layer's q and k are rotated: a quantized cache and a power-of-two head size."""
    return quantized_cache and head_dim > 1 and head_dim & (head_dim - 1) == 0


@functools.cache
def hadamard_matrix(dim: int, device: torch.device) -> torch.Tensor:
    """[dim, dim] float32 Sylvester Hadamard matrix over sqrt(dim): symmetric, orthonormal."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / dim**0.5).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] rows times H, computed in float32, in x's dtype."""
    return (x.float() @ hadamard_matrix(x.shape[-1], x.device)).to(x.dtype)
