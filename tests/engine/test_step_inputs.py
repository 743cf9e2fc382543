"""A step's batch tensors: which decode steps say their sequences share a cached prefix (the
attention kernels then read it once per tile of sequences), and what they say."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet_engine.runner.inputs import SHARED_PREFIX_MIN_SEQS, build_inputs

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


def described(items: list[Item], shared_prefix_min: int = 64) -> list[int] | None:
    inputs = build_inputs(items, BLOCK, torch.device("cpu"), {}, shared_prefix_min)
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
