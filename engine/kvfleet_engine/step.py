"""A step as the scheduler plans it and the model runner computes it: each request's share of
the step (its tokens, positions and blocks) in batch order. Plain records, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_engine.sampling import SamplingParams

# Stands for a token sampled by the previous step whose value only the device has yet.
PENDING_TOKEN = -1


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step. Lists are the request's own: read, never modify."""

    # The request's id.
    request_id: str
    # Token ids to compute now: a prompt chunk, or the newest token when decoding
    # (PENDING_TOKEN: the token this request sampled in the previous step, still on the device).
    token_ids: list[int]
    # Position of token_ids[0]; the KV of every earlier token is already in the cache.
    start_position: int
    # The request's block table: KV block ids in order.
    block_ids: list[int]
    # True when this step reaches the request's last known token, so a new token is sampled.
    sample: bool
    # How to sample.
    params: SamplingParams
    # Prompt token ids (repetition penalty looks at them).
    prompt_token_ids: list[int]
    # Tokens generated so far (penalties look at them).
    output_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What the model runner computes in one step."""

    # Requests in batch order; the runner packs their token_ids back to back.
    requests: list[ScheduledRequest]
    # Sum of len(token_ids) over requests.
    num_batched_tokens: int
    # Requests that ended since the last step; the runner drops any state it keeps for them.
    finished_request_ids: frozenset[str]
