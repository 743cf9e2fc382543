"""The records the API process and the engine-core process exchange, and their encoding.

Every message is one tagged msgspec Struct, encoded as a MessagePack array and sent as one
frame over the pipe between the two processes. A request crosses once (`AddRequest`); each step
crosses back as one `StepOutputs` holding, per request that progressed, only its new token ids
(and logprobs): never the whole list again. Commands are records too: aborts, named calls
(`Call` with a name from `CALLS`) and shutdown. No callable ever crosses.

Why msgspec over a multiprocessing pipe: a 256-request step record (columnar, 11.6 kB) encodes
in 9-10 µs and decodes in 37-39 µs with msgspec, against 23-37 / 47-61 µs with pickle and
25-27 / 28-61 µs with msgpack (the Python package), on this project's 2-core CPU machine. A full
round trip of that record (encode, send, decode, re-encode, send back, decode) took a median of
165-257 µs over a `multiprocessing.Pipe` (a Unix socketpair) against 361-368 µs over a ZeroMQ
PAIR socket on `ipc://` (three interleaved runs of 3,000 round trips each; a later short run on
the same, then busier, machine had 261 against 190 µs: the two are within its noise).
`python -m kvfleet_engine.bench.ipc` reproduces it. Either is ~1-2% of a 17 ms step, so the
transport is not what limits serving; the pipe needs no extra dependency and no socket file.

PROTOCOL_VERSION changes whenever a record changes shape; the core announces it in `CoreReady`
and the client refuses a core that speaks another version.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvfleet_engine.core.capacity import CapacityReport
from kvfleet_engine.core.profile import ProcessProfile
from kvfleet_engine.outputs import SchedulerStats

PROTOCOL_VERSION = 4  # 4: SchedulerStats' steps by kind


class _Record(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every message: encoded as [tag, field, ...]."""


# --- API process -> engine core ----------------------------------------------------------------


class AddRequest(_Record, tag="add"):
    # The id outputs come back under; unique among running requests.
    request_id: str
    # The tokenized prompt.
    prompt_token_ids: list[int]
    # SamplingParams as {field: value}; the core rebuilds (and so re-validates) it.
    params: dict[str, Any]
    # Lower runs first.
    priority: int
    # When the request reached the API process (time.time()).
    arrival_time: float


class AbortRequests(_Record, tag="abort"):
    # Requests to drop (the client went away, a stop string matched, the drain timed out).
    request_ids: list[str]


class Call(_Record, tag="call"):
    # Echoed in the CallResult.
    call_id: int
    # One of CALLS.
    name: str
    # The call's keyword arguments.
    args: dict[str, Any] = {}


class Shutdown(_Record, tag="shutdown"):
    """Finish nothing more; exit."""


ToCore = AddRequest | AbortRequests | Call | Shutdown


# --- engine core -> API process ----------------------------------------------------------------


class CoreReady(_Record, tag="ready"):
    # PROTOCOL_VERSION of the core.
    protocol_version: int
    # The core process's id.
    pid: int
    # KV-cache blocks the core allocated, and tokens per block.
    num_blocks: int
    block_size: int
    # The device the model runs on, e.g. "cuda:0".
    device: str
    # Seconds from process start to the model and KV cache being ready.
    load_s: float


class CoreFailed(_Record, tag="failed"):
    # Why the core stopped (a model that does not load, or the step loop's exception).
    error: str
    # True when it is the user's input that is wrong (a bad checkpoint or setting).
    user_error: bool = False


class Started(msgspec.Struct, array_like=True, gc=False):
    """Facts about a request known at its first token."""

    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int
    # When the scheduler first gave it tokens to compute (time.time()).
    first_scheduled_time: float
    # When the core queued it (applied its AddRequest; time.time()).
    added_time: float


class Finished(msgspec.Struct, array_like=True, gc=False):
    """How a request ended."""

    # "stop" | "length"
    finish_reason: str
    # The stop token id that ended it, if one did.
    stop_reason: int | str | None
    # When it finished (time.time()).
    finished_time: float


class StepOutputs(_Record, tag="step"):
    # Requests that got tokens in this step, in batch order.
    request_ids: list[str]
    # Per entry of request_ids: the token ids it got in this step (one per step today).
    new_token_ids: list[list[int]]
    # When the step's tokens reached the host (time.time()).
    timestamp: float
    # The scheduler and KV cache after the step.
    stats: SchedulerStats
    # request id -> {token id: logprob} per new token, for requests that asked for logprobs.
    new_logprobs: dict[str, list[dict[int, float]]] = {}
    # request id -> its first-token facts, in the step of its first token.
    started: dict[str, Started] = {}
    # request id -> how it ended, in the step of its last token.
    finished: dict[str, Finished] = {}
    # request id -> why the core refused it (it validates again; the API process checks first).
    rejected: dict[str, str] = {}


class CallResult(_Record, tag="result"):
    # The Call's call_id.
    call_id: int
    # The call's return value as plain data (convert with CALLS[name]); None on error.
    result: Any = None
    # The exception's message when the call failed.
    error: str | None = None


FromCore = CoreReady | CoreFailed | StepOutputs | CallResult


# Named calls the core answers -> the type of their result (None: they return nothing).
CALLS: dict[str, type | None] = {
    "measure_capacity": CapacityReport,
    "profile": ProcessProfile,
    "set_token_budget": None,
    "stats": SchedulerStats,
}


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def to_core_decoder() -> msgspec.msgpack.Decoder[ToCore]:
    return msgspec.msgpack.Decoder(ToCore)


def from_core_decoder() -> msgspec.msgpack.Decoder[FromCore]:
    return msgspec.msgpack.Decoder(FromCore)
