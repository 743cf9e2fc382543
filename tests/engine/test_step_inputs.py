"""A step's batch tensors: which steps say their decode rows share a cached prefix (the
attention kernels then read it once per tile of sequences), and what they say; which steps with
prompt tokens send their one-token sequences to the decode kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet_engine.runner.inputs import (
    DECODES_APART_MIN_SEQS,
    SHARED_PREFIX_MIN_SEQS,
    AttentionFeatures,
    build_inputs,
)

BLOCK = 16


@dataclass
class Item:
    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool = True


def decodes(tables: list[list[int]], contexts: list[int]) -> list[Item]:
    """One decode token per sequence at position context - 1."""
    return [
        Item(f"r{i}", [5], context - 1, table)
        for i, (table, context) in enumerate(zip(tables, contexts, strict=True))
    ]


def described(
    items: list[Item], shared_prefix_min: int = 64, apart: bool = False
) -> list[int] | None:
    features = AttentionFeatures(shared_prefix_min, apart)
    inputs = build_inputs(items, BLOCK, torch.device("cpu"), {}, features)
    shared = inputs.attention.shared_prefix
    return None if shared is None else shared.tolist()


def test_sequences_sharing_leading_blocks_describe_the_prefix_and_its_sharers() -> None:
    n = SHARED_PREFIX_MIN_SEQS
    prefix = [7, 8, 9, 10, 11]  # 80 tokens
    tables = [[*prefix, 100 + i, 200 + i] for i in range(n)]
    tables.append([50, 51, 52, 53, 54, 55])  # a sequence of its own: not a sharer
    contexts = [100] * n + [90]
    assert described(decodes(tables, contexts)) == [80, 0, *([80] * n), 0]


def test_the_prefix_stops_where_a_sharer_diverges_or_before_its_newest_token() -> None:
    n = SHARED_PREFIX_MIN_SEQS
    tables = [[7, 8, 9, 10, 11, 100 + i] for i in range(n)]
    tables[3] = [7, 8, 9, 10, 99, 98]  # diverges at the fifth block: four are shared
    assert described(decodes(tables, [96] * n))[:2] == [64, 0]
    # A sharer whose context ends in the fifth block writes its new token there: four again.
    tables = [[7, 8, 9, 10, 11, 100 + i] for i in range(n)]
    contexts = [96] * n
    contexts[5] = 65  # its newest token is the first of block 11 (position 64)
    assert described(decodes(tables, contexts))[:2] == [64, 0]


def test_no_description_below_the_thresholds_or_outside_decode_steps() -> None:
    n = SHARED_PREFIX_MIN_SEQS
    tables = [[7, 8, 9, 10, 100 + i] for i in range(n)]
    assert described(decodes(tables, [70] * n), shared_prefix_min=0) is None  # off
    assert described(decodes(tables, [70] * n), shared_prefix_min=128) is None  # 64 too few
    assert described(decodes(tables[:-1], [70] * (n - 1))) is None  # too few sequences
    prompt = [*decodes(tables[:-1], [70] * (n - 1)), Item("p", [1, 2, 3], 64, tables[-1])]
    assert described(prompt) is None  # a step with prompt tokens: the prefill kernel's


def test_a_mixed_step_sends_its_decodes_apart_and_describes_their_prefix() -> None:
    n = DECODES_APART_MIN_SEQS
    prefix = [7, 8, 9, 10]  # 64 tokens
    tables = [[*prefix, 100 + i] for i in range(n)]
    prompt = Item("p", list(range(30)), 40, [*prefix, 300, 301])  # a chunk on the same prefix
    step = [*decodes(tables, [70] * n), prompt]
    features = AttentionFeatures(shared_prefix_min=64, decodes_apart=True)
    meta = build_inputs(step, BLOCK, torch.device("cpu"), {}, features).attention
    assert meta.decodes_apart and not meta.is_decode
    # The decode rows share the prefix; the chunk, though it holds the same blocks, is the
    # prefill kernel's.
    assert meta.shared_prefix is not None
    assert meta.shared_prefix.tolist() == [64, 0, *([64] * n), 0]
    assert described(step, apart=False) is None  # decodes left to the prefill kernel
    off = build_inputs(step, BLOCK, torch.device("cpu"), {}, AttentionFeatures()).attention
    assert not off.decodes_apart and off.shared_prefix is None


def test_a_mixed_step_with_few_decodes_leaves_them_to_the_prefill_kernel() -> None:
    n = DECODES_APART_MIN_SEQS - 1
    tables = [[7, 8, 9, 10, 100 + i] for i in range(n)]
    step = [*decodes(tables, [70] * n), Item("p", [1, 2, 3], 64, [7, 8, 9, 10, 300])]
    features = AttentionFeatures(shared_prefix_min=64, decodes_apart=True)
    meta = build_inputs(step, BLOCK, torch.device("cpu"), {}, features).attention
    assert not meta.decodes_apart and meta.shared_prefix is None
    # Apart, with too few sharers among the decodes (the chunk does not count): no prefix.
    tables = [[7, 8, 9, 10, 100 + i] for i in range(n)] + [[40 + i, 41, 42, 43] for i in range(2)]
    step = [*decodes(tables, [70] * n + [60, 60]), Item("p", [1, 2], 64, [7, 8, 9, 10, 300])]
    meta = build_inputs(step, BLOCK, torch.device("cpu"), {}, features).attention
    assert meta.decodes_apart and meta.shared_prefix is None
