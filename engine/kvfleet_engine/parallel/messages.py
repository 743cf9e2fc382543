"""The records between the driver (rank 0) and the other ranks, over the step channel (one
socket per rank, msgpack; never a pickle, never a callable).

    worker                                  driver
    Hello(rank, pid)         ------------>  (every rank connected: all join torch.distributed)
    Loaded(rank)             ------------>  (every rank has its weights)
                             <------------  Measure()
    Measured(rank, blocks)   ------------>  (the smallest count wins)
                             <------------  Allocate(num_blocks)
    Ready(rank)              ------------>  (KV cache allocated, decode graphs captured)
                             <------------  Step(...) per step, Stop() at the end
    Failed(rank, error)      ------------>  whenever a rank cannot go on
"""

from __future__ import annotations

import msgspec


class Hello(msgspec.Struct, tag="hello"):
    rank: int
    pid: int


class Loaded(msgspec.Struct, tag="loaded"):
    rank: int


class Measured(msgspec.Struct, tag="measured"):
    rank: int
    # KV blocks this rank's free memory holds.
    num_blocks: int


class Ready(msgspec.Struct, tag="ready"):
    rank: int


class Failed(msgspec.Struct, tag="failed"):
    rank: int
    # Why the rank stopped.
    error: str
    # A setting or the checkpoint is at fault (the driver raises ValueError).
    user_error: bool = False


class Measure(msgspec.Struct, tag="measure"):
    pass


class Allocate(msgspec.Struct, tag="allocate"):
    # KV blocks every rank allocates (the smallest any rank measured).
    num_blocks: int


class SamplingRow(msgspec.Struct, array_like=True, gc=False):
    """A request's sampling settings, sent once to a pipeline's last stage (which samples)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int | None
    # The prompt, for penalties (empty without them).
    prompt_token_ids: list[int]


class Step(msgspec.Struct, tag="step", gc=False):
    """One step's diff: what changed since the previous one. A request's block table is sent
    whole once (and again only if it changed other than by growing), then only its new
    blocks; its tokens are those it computes in this step (a decode: one id)."""

    # Requests in batch order.
    request_ids: list[str]
    # Each request's tokens to compute now (PENDING_TOKEN: its sample from the previous step).
    token_ids: list[list[int]]
    # Position of each request's first token in this step.
    start_positions: list[int]
    # Blocks appended to each request's table since it was last sent (all of it when reset).
    new_block_ids: list[list[int]]
    # Rows whose table new_block_ids holds whole (first seen, or changed by a preemption).
    reset_rows: list[int]
    # Rows that sample a token in this step, in order.
    sample_rows: list[int]
    # Requests that ended since the previous step: their tables are dropped.
    finished_request_ids: list[str]
    # Pipeline parallelism only (the last stage samples): row -> the settings of a request the
    # workers have not seen yet, and row -> the output tokens so far of a row with penalties.
    new_sampling: dict[int, SamplingRow] = {}
    penalty_output_ids: dict[int, list[int]] = {}


class Stop(msgspec.Struct, tag="stop"):
    pass


ToWorker = Measure | Allocate | Step | Stop
FromWorker = Hello | Loaded | Measured | Ready | Failed

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
to_worker = msgspec.msgpack.Decoder(ToWorker)
from_worker = msgspec.msgpack.Decoder(FromWorker)
