"""What the engine hands back: per-request outputs and plain statistics records."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    # Which of the request's n completions this is.
    index: int
    # Generated text so far (cumulative); a matched stop string is left out.
    text: str
    # Generated token ids so far (cumulative).
    token_ids: list[int]
    # Sum of the sampled tokens' logprobs; None unless logprobs were requested.
    cumulative_logprob: float | None
    # Per generated token: {token_id: logprob} with the sampled token and the top-n.
    logprobs: list[dict[int, float]] | None
    # "stop" | "length" | "abort"; None while running.
    finish_reason: str | None
    # The stop string or stop token id that ended it, if any.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()); None until the event happens."""

    # When the request reached the engine.
    arrival_time: float
    # When the scheduler first gave it tokens to compute.
    first_scheduled_time: float | None = None
    # When its first output token was sampled.
    first_token_time: float | None = None
    # When its latest output token was sampled.
    last_token_time: float | None = None
    # When it finished (stop, length or abort).
    finished_time: float | None = None


@dataclass
class RequestOutput:
    # The id given to add_request (or the LLM's own numbering).
    request_id: str
    # Prompt text when the caller gave text, else None.
    prompt: str | None
    # The tokens the model was conditioned on.
    prompt_token_ids: list[int]
    # One entry per completion (n of them for LLM.generate with n > 1).
    outputs: list[CompletionOutput]
    # True once every completion has finished.
    finished: bool
    # Prompt tokens served from the prefix cache on first scheduling.
    num_cached_tokens: int
    # Timing of the request.
    metrics: RequestMetrics


# What a step computed: only prompt tokens (a preempted request's recomputed tokens count as
# such), prompt tokens beside decode rows (one generated token each), only decode rows.
STEP_KINDS = ("prefill", "mixed", "decode")


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler and KV cache; the server turns it into Prometheus metrics."""

    # Requests holding KV blocks and taking part in steps.
    num_running: int
    # Requests queued (new or preempted).
    num_waiting: int
    # Fraction of KV blocks in use by requests (0..1); cached free blocks count as free.
    kv_cache_usage: float
    # Times a running request was preempted (its KV freed, to be recomputed).
    num_preemptions_total: int
    # Prompt tokens looked up in the prefix cache.
    prefix_cache_queries_total: int
    # Of those, tokens found in the cache.
    prefix_cache_hits_total: int
    # Prompt tokens of requests admitted for the first time.
    num_prompt_tokens_total: int
    # Tokens sampled.
    num_generation_tokens_total: int
    # KV blocks in the pool.
    num_blocks_total: int
    # KV blocks not held by any request (includes evictable cached blocks).
    num_blocks_free: int
    # Steps whose decode rows read a prefix many of them share once (`kernels.shared_prefix`).
    shared_prefix_steps_total: int = 0
    # Steps by kind (STEP_KINDS).
    prefill_steps_total: int = 0
    mixed_steps_total: int = 0
    decode_steps_total: int = 0


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What one model step produced, as plain Python values (no tensors)."""

    # request id -> sampled token id, for every scheduled request that sampled this step.
    sampled_token_ids: dict[str, int]
    # request id -> {token id: logprob} (sampled token plus the top-n), when it asked for them.
    logprobs: dict[str, dict[int, float]]
