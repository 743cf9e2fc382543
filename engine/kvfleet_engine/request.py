"""One request's state inside the engine: tokens, progress, KV blocks, status, timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvfleet_engine.outputs import RequestMetrics
from kvfleet_engine.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every value above PREEMPTED is a finished state."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Tokens that end generation unless params.ignore_eos (the model's end-of-sequence ids).
    eos_token_ids: frozenset[int] = frozenset()
    # Lower runs first; ties go by arrival.
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    # Admission counter set by the scheduler; breaks arrival-time ties.
    seq_no: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (cached prefix + computed so far), counted when a step
    # is scheduled: a scheduled step is as good as done (steps run in order on one stream).
    num_computed_tokens: int = 0
    # Output tokens sampled by scheduled steps whose values the host has not seen yet (async
    # scheduling: at most one, whose successor step takes it as input on the device).
    num_pending_tokens: int = 0
    # Prompt tokens found in the prefix cache when first scheduled (-1: not scheduled yet).
    num_cached_tokens: int = -1
    # KV blocks holding this request's tokens, in order.
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of this request's full blocks, filled lazily by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks of block_ids already offered to the prefix cache.
    num_registered_blocks: int = 0
    # Per output token: {token_id: logprob}, when params.logprobs is set.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.all_token_ids = list(self.prompt_token_ids)
        # Looked up after every sampled token (the scheduler's stop check).
        self.stop_token_ids = frozenset(self.params.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Known tokens plus those a scheduled step will have sampled."""
        return len(self.all_token_ids) + self.num_pending_tokens

    def reaches_limit(self, max_model_len: int) -> bool:
        """The tokens already scheduled end it by length (max_tokens or max_model_len), so it
        needs no further step."""
        return (
            self.num_output_tokens + self.num_pending_tokens >= self.params.max_tokens
            or self.num_scheduled_tokens >= max_model_len
        )

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.seq_no)
