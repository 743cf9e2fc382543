"""One step's batch tensors, built with numpy in one host buffer (int64 segments, then int32
ones) that reaches the device in one copy. The driver builds them from the scheduler's
ScheduledRequests, a worker from the same fields rebuilt from the step diff.

What the step asks of the attention kernels beyond the plain paged ones depends on the backend and
the settings (`AttentionFeatures`, the executor's):
- a step with prompt tokens and at least DECODES_APART_MIN_SEQS one-token sequences
  (`decodes_apart`) has the decode kernels attend those, split across their context, and the
  prefill kernel the rest (`kernels.decode_attention`);
- when at least SHARED_PREFIX_MIN_SEQS of a step's decode rows (all its rows in a decode step,
  the one-token ones in a step whose decodes go apart) start with the same cache blocks, holding
  at least `shared_prefix_min` tokens, the metadata describes them (`shared_prefix`): the
  attention kernels then read them once per tile of sequences (`kernels.shared_prefix`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvfleet_engine.layers.attention import AttentionMetadata
from kvfleet_engine.layers.sampler import SamplingMetadata
from kvfleet_engine.step import PENDING_TOKEN

# Fewer sequences than this never share a prefix read: the prefix kernel's launch and the merge
# of its partial results would cost about what the shared reads save.
SHARED_PREFIX_MIN_SEQS = 16
# The `shared_prefix_min` the runner passes: a shorter shared prefix is read per sequence (an 8B
# layer on the H200, 16 sequences of 2,048 tokens with 1,536 shared: 31.4 -> 26.9 us; shorter
# prefixes, whose saving shrinks while the prefix kernel and the merge still cost a launch each,
# were not measured).
SHARED_PREFIX_MIN_TOKENS = 512
# A step with prompt tokens leaves fewer one-token sequences than this to the prefill kernel,
# whose tiles spend 16 query rows on each one's single query and walk its context in one program.
# From 16 on, the decode kernels' split reads pay (H200, an 8B layer, a 512-token chunk beside
# 2,048-token decode rows, 1,536 tokens shared: 16 rows 101.4 -> 88.3 us, over the shared prefix
# 83.8; 64 rows 167.6 -> 145.8 / 119.4; fewer rows were not measured).
DECODES_APART_MIN_SEQS = 16


@dataclass(frozen=True)
class AttentionFeatures:
    """What the step's attention kernels may be asked beyond the plain paged ones."""

    shared_prefix_min: int = 0  # tokens a shared prefix needs to be read once (0: never)
    decodes_apart: bool = False  # a mixed step's one-token sequences go to the decode kernels


class BatchItem(Protocol):
    """What the batch needs of one request's share of a step (a ScheduledRequest has it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def start_position(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...
    @property
    def sample(self) -> bool: ...


@dataclass
class ModelInputs:
    """One step's batch on the device."""

    # [num_tokens] int64: token ids, sequences back to back.
    input_ids: torch.Tensor
    # [num_tokens] int64: position of each token in its sequence.
    positions: torch.Tensor
    # Paged-cache addressing for the attention layers.
    attention: AttentionMetadata
    # [num_sampling_rows] int64: index into the tokens of each row whose logits are sampled.
    logits_indices: torch.Tensor
    # [num_tokens] int64: for a PENDING_TOKEN input, its row in the previous step's samples
    # (-1 for the others); None when the step has no pending input.
    pending_sources: torch.Tensor | None
    # Request id of each sampling row, in row order.
    sampling_request_ids: list[str]
    # Settings of each sampling row (None on a worker rank: the driver samples).
    sampling: SamplingMetadata | None = None
    # Top-n logprobs wanted per sampling row (None: none).
    num_logprobs: list[int | None] | None = None


def build_inputs(
    items: Sequence[BatchItem],
    block_size: int,
    device: torch.device,
    last_sample_rows: dict[str, int],  # request id -> its row in the previous step's samples
    features: AttentionFeatures = AttentionFeatures(),
) -> ModelInputs:
    """The batch tensors of `items` (in batch order); sampling settings are left to the caller."""
    num_seqs = len(items)
    lens = np.fromiter((len(item.token_ids) for item in items), np.int64, num_seqs)
    num_tokens = int(lens.sum())
    is_decode = num_tokens == num_seqs
    sample_rows = [row for row, item in enumerate(items) if item.sample]
    counts = np.fromiter((len(item.block_ids) for item in items), np.int64, num_seqs)
    width = int(counts.max())

    # One host buffer, one copy: int64 segments then int32 ones, each starting on 16 bytes
    # (Triton specialises kernels on pointer alignment: a view whose alignment changed with
    # the batch would compile a new variant mid-run).
    segments64, size64 = _segments([num_tokens] * 3 + [len(sample_rows), num_tokens], 2)
    segments32, size32 = _segments([num_seqs, num_seqs + 1, num_seqs * width, num_seqs + 2], 4)
    size64 += size64 % 2  # the int32 part starts on 16 bytes too
    host, upload = _staging(size64 + -(-size32 // 2), device)
    host_int32 = host[size64:].view(np.int32)
    input_ids, positions, slot_mapping, logits_indices, sources = (host[s] for s in segments64)
    context_lens, cu_query_lens = host_int32[segments32[0]], host_int32[segments32[1]]
    block_tables = host_int32[segments32[2]].reshape(num_seqs, width)
    prefix = host_int32[segments32[3]]  # [2 + num_seqs] (`kernels.shared_prefix`)

    starts = np.fromiter((item.start_position for item in items), np.int64, num_seqs)
    if is_decode:
        input_ids[:] = [item.token_ids[0] for item in items]
        positions[:] = starts
        cu_query_lens[:] = np.arange(num_seqs + 1)
        rows = np.arange(num_seqs)
    else:
        input_ids[:] = list(itertools.chain.from_iterable(item.token_ids for item in items))
        cu_query_lens[0] = 0
        np.cumsum(lens, out=cu_query_lens[1:])
        rows = np.repeat(np.arange(num_seqs), lens)
        positions[:] = np.arange(num_tokens) + (starts - cu_query_lens[:-1])[rows]
    context_lens[:] = starts + lens
    flat_blocks = np.fromiter(
        itertools.chain.from_iterable(item.block_ids for item in items),
        np.int32,
        int(counts.sum()),
    )
    block_tables[:] = 0
    block_tables[np.arange(width) < counts[:, None]] = flat_blocks  # row-major = chain order
    slot_mapping[:] = block_tables[rows, positions // block_size]
    slot_mapping *= block_size
    slot_mapping += positions % block_size
    decodes = np.flatnonzero(lens == 1)  # every row in a decode step
    apart = not is_decode and features.decodes_apart and decodes.size >= DECODES_APART_MIN_SEQS
    shared = False
    if (is_decode or apart) and features.shared_prefix_min:
        found = shared_prefix(block_tables, counts, context_lens, block_size, decodes)
        blocks, holder, sharers = found
        shared = blocks * block_size >= features.shared_prefix_min
        if shared:
            prefix[:2] = blocks * block_size, holder
            prefix[2:] = sharers * (blocks * block_size)
    logits_indices[:] = cu_query_lens[1:][sample_rows] - 1
    pending = np.flatnonzero(input_ids == PENDING_TOKEN)
    if pending.size:
        sources[:] = -1
        sources[pending] = [
            last_sample_rows[items[row].request_id] for row in rows[pending].tolist()
        ]

    dev64 = upload()
    dev32 = dev64[size64:].view(torch.int32)
    attention = AttentionMetadata(
        slot_mapping=dev64[segments64[2]],
        block_tables=dev32[segments32[2]].view(num_seqs, width),
        context_lens=dev32[segments32[0]],
        cu_query_lens=dev32[segments32[1]],
        is_decode=is_decode,
        shared_prefix=dev32[segments32[3]] if shared else None,
        decodes_apart=apart,
    )
    return ModelInputs(
        input_ids=dev64[segments64[0]],
        positions=dev64[segments64[1]],
        attention=attention,
        logits_indices=dev64[segments64[3]],
        pending_sources=dev64[segments64[4]] if pending.size else None,
        sampling_request_ids=[items[row].request_id for row in sample_rows],
    )


def shared_prefix(
    block_tables: np.ndarray,  # [num_seqs, width] int32
    counts: np.ndarray,  # [num_seqs]: each row's blocks
    context_lens: np.ndarray,  # [num_seqs]: tokens after this step's
    block_size: int,
    candidates: np.ndarray,  # the rows that may share: the step's one-token sequences
) -> tuple[int, int, np.ndarray]:
    """(blocks, a holder's row, [num_seqs] 0/1 sharers): the leading cache blocks that the
    largest group of candidate sequences with the same first block all have, counting only
    blocks each holds in full before its newest token (the one a decode step writes); (0, 0,
    zeros) when fewer than SHARED_PREFIX_MIN_SEQS sequences share one."""
    none = (0, 0, np.zeros(len(counts), np.int32))
    if candidates.size < SHARED_PREFIX_MIN_SEQS:
        return none
    first = block_tables[candidates, 0]
    _, group, sizes = np.unique(first, return_inverse=True, return_counts=True)
    if sizes.max() < SHARED_PREFIX_MIN_SEQS:
        return none
    rows = candidates[group == sizes.argmax()]
    sharers = np.zeros(len(counts), bool)
    sharers[rows] = True
    limit = min(int((context_lens[rows].min() - 1) // block_size), int(counts[rows].min()))
    if limit <= 0:
        return none
    tables = block_tables[rows, :limit]
    same = (tables == tables[0]).all(axis=0)
    blocks = limit if same.all() else int(same.argmin())
    return blocks, int(rows[0]), sharers.astype(np.int32)


def _staging(size: int, device: torch.device) -> tuple[np.ndarray, Callable[[], torch.Tensor]]:
    """A fresh int64 host buffer (pinned on a GPU; the caching host allocator reuses it once
    its copy is done) as numpy to fill, and a function that ships it to the device."""
    host = torch.empty(size, dtype=torch.int64, pin_memory=device.type == "cuda")
    if device.type == "cpu":
        return host.numpy(), lambda: host
    return host.numpy(), lambda: host.to(device, non_blocking=True)


def _segments(sizes: list[int], align: int) -> tuple[list[slice], int]:
    """Segments of the given sizes packed in order, each starting at a multiple of `align`
    elements, and the total size."""
    segments, end = [], 0
    for size in sizes:
        start = -(-end // align) * align
        end = start + size
        segments.append(slice(start, end))
    return segments, end
