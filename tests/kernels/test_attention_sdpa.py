"""The CPU backend (torch's scaled_dot_product_attention) against dense attention, on the cases
the reference is tested with, and with garbage in the cache slots past each sequence."""

from __future__ import annotations

import pytest
import torch
from paged_cases import dense_attention, make_paged_case, relative_error

from kvfleet_engine.layers import attention_sdpa as sdpa


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "context_lens"),
    [(8, 2, [1, 15, 16, 17, 100]), (4, 4, [33, 2]), (6, 1, [64])],
)
def test_decode_matches_dense_attention(num_q_heads, num_kv_heads, context_lens) -> None:
    case = make_paged_case(context_lens, [1] * len(context_lens), num_q_heads, num_kv_heads)
    out = sdpa.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale
    )
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    assert relative_error(out, dense_attention(case)) < 1e-5


@pytest.mark.parametrize(
    ("context_lens", "query_lens"),
    [
        ([5, 40, 16], [5, 40, 16]),  # fresh prompts
        ([40, 70, 9], [8, 1, 9]),  # cached prefixes, one decode-like token, one fresh prompt
        ([33, 20], [0, 20]),  # a sequence with no query tokens this step
    ],
)
def test_prefill_matches_dense_causal_attention(context_lens, query_lens) -> None:
    case = make_paged_case(context_lens, query_lens, block_size=8)
    out = sdpa.prefill_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.cu_query_lens,
        case.context_lens,
        case.scale,
    )
    assert relative_error(out, dense_attention(case)) < 1e-5


def test_decode_ignores_nan_in_slots_past_each_sequence() -> None:
    case = make_paged_case([30, 7], [1, 1], dtype=torch.bfloat16)
    k_cache = torch.full_like(case.k_cache, float("nan"))
    v_cache = torch.full_like(case.v_cache, float("nan"))
    sdpa.store_kv(torch.cat(case.keys), torch.cat(case.values), k_cache, v_cache, case.slot_mapping)
    out = sdpa.paged_decode_attention(
        case.query, k_cache, v_cache, case.block_tables, case.context_lens, case.scale
    )
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert relative_error(out, dense_attention(case)) < 1e-2
