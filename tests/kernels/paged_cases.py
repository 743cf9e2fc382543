"""Random paged-attention problems and a dense reference computed without the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim], sequences back to back
    keys: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], NaN where unused
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, blocks in random order
    slot_mapping: torch.Tensor  # [sum(context_lens)] int64, every context token's slot
    cu_query_lens: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    scale: float


def make_paged_case(
    context_lens: list[int],
    query_lens: list[int],
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    shared_blocks: int = 0,
) -> PagedCase:
    """Scatter random K/V of each sequence into shuffled cache blocks (unused slots hold NaN, so
    a kernel that reads past a context shows it) and draw queries for each sequence's last
    `query_lens[s]` positions. `shared_blocks`: every sequence's first blocks are the same
    blocks, holding the same K/V (a prefix-cache hit)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shared_ids = [order.pop(0) for _ in range(shared_blocks)]
    shared_len = shared_blocks * block_size
    shared_k = randn(shared_len, num_kv_heads, head_dim)
    shared_v = randn(shared_len, num_kv_heads, head_dim)
    max_blocks = max(blocks_per_seq) + 1
    # Padding entries point at a real (NaN-filled or foreign) block: kernels must not read them.
    block_tables = torch.full((len(context_lens), max_blocks), order[-1], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    keys, values, slots = [], [], []
    for seq, (n, nb) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        assert not shared_blocks or n > shared_len, "each sequence holds the shared blocks, more"
        ids = shared_ids + [order.pop(0) for _ in range(nb - shared_blocks)]
        block_tables[seq, :nb] = torch.tensor(ids, dtype=torch.int32)
        positions = torch.arange(n)
        seq_slots = torch.tensor(ids)[positions // block_size] * block_size + positions % block_size
        k, v = randn(n, num_kv_heads, head_dim), randn(n, num_kv_heads, head_dim)
        k[:shared_len], v[:shared_len] = shared_k, shared_v
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots.to(device)] = k
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots.to(device)] = v
        keys.append(k)
        values.append(v)
        slots.append(seq_slots)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedCase(
        query=randn(sum(query_lens), num_q_heads, head_dim),
        keys=keys,
        values=values,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        cu_query_lens=cu.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def dense_attention(case: PagedCase) -> torch.Tensor:
    """Causal grouped-query attention in float64, straight from the unpaged K/V."""
    num_q_heads = case.query.shape[1]
    cu = case.cu_query_lens.tolist()
    out = torch.empty(case.query.shape, dtype=torch.float64)
    for seq, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        context_len, num_kv_heads, _ = k.shape
        q = case.query[cu[seq] : cu[seq + 1]].double().cpu()  # [q_len, num_q_heads, head_dim]
        q_len = q.shape[0]
        kv_head_of = torch.arange(num_q_heads) // (num_q_heads // num_kv_heads)
        kh = k.double().cpu()[:, kv_head_of]  # [context_len, num_q_heads, head_dim]
        vh = v.double().cpu()[:, kv_head_of]
        positions = torch.arange(context_len - q_len, context_len)
        mask = torch.arange(context_len)[None, :] > positions[:, None]  # [q_len, context_len]
        scores = torch.einsum("thd,chd->htc", q, kh) * case.scale
        weights = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        out[cu[seq] : cu[seq + 1]] = torch.einsum("htc,chd->thd", weights, vh)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.double().cpu()
    assert torch.isfinite(out64).all(), (
        "output has NaN/inf (unwritten rows or reads past a context)"
    )
    return float((out64 - ref).norm() / ref.norm())
