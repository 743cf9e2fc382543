"""The plain-torch paged attention (the reference for every kernel) and the CPU backend built on
torch's scaled_dot_product_attention, against dense attention."""

from __future__ import annotations

import pytest
import torch
from paged_cases import dense_attention, make_paged_case, relative_error

from kvfleet_engine.layers import attention_sdpa, attention_torch

BACKENDS = pytest.mark.parametrize(
    "backend", [attention_torch, attention_sdpa], ids=["torch", "sdpa"]
)


def test_store_kv_writes_each_slot_and_skips_minus_one() -> None:
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    attention_torch.store_kv(key, value, k_cache, v_cache, torch.tensor([17, -1, 5]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], value[0])
    assert torch.equal(k_cache[0, 5], key[2]) and torch.equal(v_cache[0, 5], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2, "only two slots were written"


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "context_lens"),
    [(8, 2, [1, 15, 16, 17, 100]), (4, 4, [33, 2]), (6, 1, [64])],
)
@BACKENDS
def test_decode_matches_dense_attention(backend, num_q_heads, num_kv_heads, context_lens) -> None:
    case = make_paged_case(context_lens, [1] * len(context_lens), num_q_heads, num_kv_heads)
    out = backend.paged_decode_attention(
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
@BACKENDS
def test_prefill_matches_dense_causal_attention(backend, context_lens, query_lens) -> None:
    case = make_paged_case(context_lens, query_lens, block_size=8)
    out = backend.prefill_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.cu_query_lens,
        case.context_lens,
        case.scale,
    )
    assert relative_error(out, dense_attention(case)) < 1e-5


@BACKENDS
def test_store_then_decode_round_trip_in_bfloat16(backend) -> None:
    """Slots past each sequence hold NaN: a backend must never let them count."""
    case = make_paged_case([30, 7], [1, 1], dtype=torch.bfloat16)
    k_cache = torch.full_like(case.k_cache, float("nan"))
    v_cache = torch.full_like(case.v_cache, float("nan"))
    backend.store_kv(
        torch.cat(case.keys), torch.cat(case.values), k_cache, v_cache, case.slot_mapping
    )
    out = backend.paged_decode_attention(
        case.query, k_cache, v_cache, case.block_tables, case.context_lens, case.scale
    )
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert relative_error(out, dense_attention(case)) < 1e-2


@pytest.mark.parametrize(
    ("context_lens", "skip_row"),
    [([37], None), ([20, 20, 20], None), ([20, 20, 20], 1), ([5, 40, 17], None), ([5, 40], 0)],
    ids=["batch1", "one-length", "one-length-skip", "lengths", "lengths-skip"],
)
def test_sdpa_fused_decode_step_is_rotary_store_then_decode(context_lens, skip_row) -> None:
    """The CPU backend's one-call decode layer: the same output and the same cache as the
    reference's rotation, store_kv and paged_decode_attention (slot -1 stores nothing), and the
    second layer of a step (its shared work reused) as right as the first."""
    from kvfleet_engine.layers.rotary import RotaryEmbedding

    case = make_paged_case(context_lens, [1] * len(context_lens), 6, 2, 32, block_size=8)
    rotary = RotaryEmbedding(32, 128, {"rope_theta": 10000.0, "rope_type": "default"})
    rotary.reset_buffers()
    positions = case.context_lens.long() - 1
    slots = torch.stack([seq_slots[-1] for seq_slots in _slots(case)])
    if skip_row is not None:
        slots[skip_row] = -1
    gen = torch.Generator().manual_seed(1)
    for layer in range(2):  # two layers of one step: the same step tensors, new activations
        query, key, value = (
            torch.randn(len(context_lens), h, 32, generator=gen) for h in (6, 2, 2)
        )
        k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
        q_rot, k_rot = rotary(positions, query, key)
        attention_torch.store_kv(k_rot, value, k_ref, v_ref, slots)
        expected = attention_torch.paged_decode_attention(
            q_rot, k_ref, v_ref, case.block_tables, case.context_lens, case.scale
        )
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = attention_sdpa.rotary_decode_attention(
            positions, query, key, value, rotary.cos_sin, k_cache, v_cache, slots,
            case.block_tables, case.context_lens, case.scale,
        )  # fmt: skip
        assert out.shape == query.shape and not out.isnan().any(), f"layer {layer}"
        assert relative_error(out, expected) < 1e-5, f"layer {layer}"
        torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


def _slots(case) -> list[torch.Tensor]:
    """Each sequence's slots, split from the case's back-to-back slot mapping."""
    return list(case.slot_mapping.split(case.context_lens.tolist()))
