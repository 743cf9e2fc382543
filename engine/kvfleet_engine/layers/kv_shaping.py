"""An fp8 cache's K rounded toward the queries (`kv_cache_calibration`).

A score's error for query q is q . d, d the stored key's rounding error (codes times scale minus
the key). Over the queries that read it, its mean square is d^T M d, M the second moment of the
layer's queries (rotated as the cache's K is, summed over the query heads of the key's kv head).
M is far from isotropic: on SmolLM2 its top eigenvalue holds 36-61% of its trace per layer, so
queries share a direction, and round-to-nearest spends as much error along it as along any other.
From nearest, each row takes up to `SHAPE_STEPS` greedy moves: the element whose other
neighbouring e4m3 code lowers d^T M d most flips to it; none moves when no flip lowers it. The
scale (`attention_torch.quantize_kv`'s rule) and the format stay; only which of the two codes
around each element is stored changes, so every reader of the cache is unchanged.

On SmolLM2 (CPU, float32, first 8,192 tokens of the perplexity text) the fp8 cache's gap went
+0.31% -> +0.12% (bench/NOTES.md section 18). M must come from text: calibrated on random token
ids it gained nothing. `kvfleet_engine.bench.calibrate_kv` writes it (`runner.kv_calibration`);
the Triton store kernel does the same moves (`kernels.kv_shaping`).

The stores use M in factored form (`KMoment`, from `factor`): its top `SHAPE_RANK` eigenpairs and
the mean of the rest, M ~ W W^T + s I. Then M d = W (W^T d) + s d costs 2 x rank multiply-adds
per element, and a move updates W^T d by one row of W: nothing per move reads memory, where the
full M cost the store kernel a 128-step loop over its rows and a dependent read of one per move
(on an H100, 4 ms per decode step of the 8B shape at any batch). On SmolLM2 over 65,536 tokens
rank 8 gives +0.30% against the full M's +0.26% (nearest +0.55%; bench/NOTES.md section 19)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
# Moves per row at most: on SmolLM2 (8,192 tokens) 4 moves gave +0.21%, 16 +0.12%, 64 +0.23%
# (M, estimated from 4,096 tokens, undervalues the directions it saw little of).
SHAPE_STEPS = 16
# Eigenpairs of M the stores keep (a power of two: the kernels' tile).
SHAPE_RANK = 8
E4M3_TOP_MAGNITUDE = 0x7E  # the bits of 448, e4m3fn's largest finite magnitude


def other_code(scaled: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The e4m3 code on the other side of `scaled` from its nearest code `codes` (both float32
    values, codes on e4m3's grid); where scaled is a code itself (or beyond 448), `codes`."""
    bits = codes.to(FP8_DTYPE).view(torch.uint8).to(torch.int32)
    magnitude, sign = bits & 0x7F, bits & 0x80
    away = codes.abs() > scaled.abs()  # nearest is farther from zero: the other is one below
    magnitude = torch.where(away, magnitude - 1, (magnitude + 1).clamp(max=E4M3_TOP_MAGNITUDE))
    zero = codes == 0  # past zero, the smallest code of scaled's sign
    magnitude = torch.where(zero, torch.ones_like(magnitude), magnitude)
    sign = torch.where(zero, (scaled < 0).to(torch.int32) * 0x80, sign)
    other = (sign | magnitude).to(torch.uint8).view(FP8_DTYPE).float()
    return torch.where(codes == scaled, codes, other)


@dataclass(frozen=True)
class KMoment:
    """One layer's query moments as the stores use them: M ~ W W^T + s I per kv head."""

    factors: torch.Tensor  # [num_kv_heads, head_dim, rank] float32: W
    isotropic: torch.Tensor  # [num_kv_heads] float32: s

    def to(self, device: torch.device | str) -> KMoment:
        return KMoment(self.factors.to(device), self.isotropic.to(device))

    def dense(self) -> torch.Tensor:
        """[num_kv_heads, head_dim, head_dim]: W W^T + s I."""
        eye = torch.eye(self.factors.shape[1], device=self.factors.device)
        return self.factors @ self.factors.mT + self.isotropic[:, None, None] * eye


def factor(moment: torch.Tensor, rank: int = SHAPE_RANK) -> KMoment:
    """`moment` ([num_kv_heads, dim, dim], symmetric) as s = the mean of its eigenvalues but
    the top `rank` (rounded down to a power of two <= dim; all of them: s = 0), and W = their
    eigenvectors times the roots of their eigenvalues less s: W W^T + s I has M's top eigenpairs
    and its trace."""
    dim = moment.shape[-1]
    rank = 1 << (min(rank, dim).bit_length() - 1)  # a power of two (the kernels' tile) <= dim
    values, vectors = torch.linalg.eigh(moment.double())  # ascending
    others = values[..., :-rank].clamp(min=0.0)
    rest = others.mean(-1) if rank < dim else torch.zeros_like(values[..., 0])
    top = (values[..., -rank:] - rest[..., None]).clamp(min=0.0)
    factors = vectors[..., -rank:] * top.sqrt()[..., None, :]
    return KMoment(factors.float().contiguous(), rest.float().contiguous())


def shaped_e4m3(
    x: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (rotated) keys, any float dtype
    nearest: torch.Tensor,  # their e4m3fn codes, rounded to nearest (`quantize_kv`)
    scales: torch.Tensor,  # [num_tokens, num_kv_heads] bfloat16, `quantize_kv`'s
    moment: KMoment,
    steps: int = SHAPE_STEPS,
) -> torch.Tensor:  # e4m3fn codes [num_tokens, num_kv_heads, head_dim]
    """Codes chosen by greedy moves from the nearest ones that lower each row's d^T M d
    (d = codes - x / scale, M ~ W W^T + s I its kv head's moment); the scales stay."""
    factors, isotropic = moment.factors, moment.isotropic[None, :, None]
    scaled = x.float() * (1.0 / scales.float())[..., None]  # as quantize_kv scales it
    codes = nearest.float()
    step = other_code(scaled, codes) - codes  # each element's move, 0 where there is none
    projected = torch.einsum("thd,hdr->thr", codes - scaled, factors)  # W^T d per row
    diagonal = (factors * factors).sum(-1)[None] + isotropic  # M's diagonal
    heads = torch.arange(factors.shape[0], device=x.device)[None, :].expand(x.shape[0], -1)
    for _ in range(steps):
        gradient = torch.einsum("thr,hdr->thd", projected, factors) + isotropic * (codes - scaled)
        change = (2 * gradient + step * diagonal) * step  # d^T M d's change if that one moves
        best = change.argmin(dim=-1, keepdim=True)
        move = step.gather(-1, best) * (change.gather(-1, best) < 0)
        moved = codes.gather(-1, best)
        codes.scatter_(-1, best, torch.where(move != 0, moved + move, moved))  # a -0 stays -0
        step.scatter_(-1, best, torch.where(move != 0, -move, step.gather(-1, best)))
        projected += move * factors[heads, best[..., 0]]
    return codes.to(FP8_DTYPE)


def query_moment(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[num_kv_heads, dim, dim] float32: the sum of q q^T over query's rows ([num_tokens,
    num_heads, dim], rotated as the cache's K is) and over each kv head's group of query heads."""
    num_tokens, num_heads, dim = query.shape
    rows = query.float().reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, dim)
    return torch.einsum("tkgd,tkge->kde", rows, rows)
