"""Admission control: a bounded waiting queue and, in SLA mode, TTFT/TPOT targets.

Pure functions of a queue snapshot and a fitted step-time model, so the decisions are testable
without an engine. The engine loop supplies the snapshot; the start-up self-benchmark supplies
the model (`kvfleet_engine.core.capacity.measure_capacity`, run in the engine core).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet_engine.core.capacity import StepTimeModel

__all__ = [
    "AdmissionConfig",
    "AdmissionPolicy",
    "QueueSnapshot",
    "Rejection",
    "StepTimeModel",
    "estimate_ttft_s",
    "sla_token_budget",
]


@dataclass(frozen=True)
class AdmissionConfig:
    max_queued_requests: int | None  # requests admitted but without a first token; None: no limit
    max_queued_tokens: int | None  # their prompt tokens; None: no limit
    ttft_slo_s: float | None  # SLA mode: refuse work whose estimated TTFT exceeds this
    tpot_slo_s: float | None  # SLA mode: cap each step's token budget so a step fits this


@dataclass(frozen=True)
class QueueSnapshot:
    num_queued_requests: int  # admitted, no first token yet
    num_queued_tokens: int  # prompt tokens of those requests
    num_running: int  # requests that are decoding (one token per step each)


@dataclass(frozen=True)
class Rejection:
    reason: str  # metric label: "queue_full" | "ttft_slo"
    param: str | None  # request field to blame, if one is to blame
    message: str  # for the client
    retry_after_s: int  # Retry-After header value


def sla_token_budget(model: StepTimeModel, tpot_slo_s: float, max_num_batched_tokens: int) -> int:
    """Per-step token budget that keeps a step (so every decode's TPOT) within the target."""
    return max(1, min(max_num_batched_tokens, model.max_tokens_within(tpot_slo_s)))


def estimate_ttft_s(
    queue: QueueSnapshot, num_prompt_tokens: int, model: StepTimeModel, token_budget: int
) -> float:
    """Time until a new request's first token if it joins the queue now.

    Each step spends one token on every running decode and the rest of the budget on queued
    prompts in arrival order; so the queue ahead plus this prompt take
    ceil(tokens / (budget - running)) steps, each running the decodes and its share of those
    tokens: the steps' fixed and decode costs plus every queued token's own cost.
    """
    prefill_per_step = token_budget - queue.num_running
    if prefill_per_step <= 0:
        return math.inf
    num_tokens = queue.num_queued_tokens + num_prompt_tokens
    num_steps = math.ceil(num_tokens / prefill_per_step)
    return num_steps * model.step_seconds(queue.num_running) + num_tokens * model.per_token_s


class AdmissionPolicy:
    """Decides, per request, whether it may join the waiting queue."""

    def __init__(self, config: AdmissionConfig, max_num_batched_tokens: int) -> None:
        self.config = config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_model: StepTimeModel | None = None  # set once the self-benchmark has run
        self.token_budget = max_num_batched_tokens  # per-step budget the scheduler runs with

    def calibrate(self, step_model: StepTimeModel) -> int | None:
        """Adopt a measured step model; returns the SLA token budget to apply, if any."""
        self.step_model = step_model
        if self.config.tpot_slo_s is None:
            return None
        self.token_budget = sla_token_budget(
            step_model, self.config.tpot_slo_s, self.max_num_batched_tokens
        )
        return self.token_budget

    def check(
        self, queue: QueueSnapshot, num_prompt_tokens: int, num_requests: int = 1
    ) -> Rejection | None:
        """None to admit; else why not. An empty queue admits anything (one request of n > the
        bound must not be refused forever, and waiting would not start it any sooner), so the
        bounds and the TTFT target apply to the queue ahead of it."""
        cfg = self.config
        retry = self._retry_after_s(queue)
        if (
            cfg.max_queued_requests is not None
            and queue.num_queued_requests > 0
            and queue.num_queued_requests + num_requests > cfg.max_queued_requests
        ):
            return Rejection(
                "queue_full",
                None,
                f"server busy: {queue.num_queued_requests} requests already waiting "
                f"(--max-queued-requests {cfg.max_queued_requests}); retry later",
                retry,
            )
        if (
            cfg.max_queued_tokens is not None
            and queue.num_queued_requests > 0
            and queue.num_queued_tokens + num_prompt_tokens > cfg.max_queued_tokens
        ):
            return Rejection(
                "queue_full",
                None,
                f"server busy: {queue.num_queued_tokens} prompt tokens already waiting "
                f"(--max-queued-tokens {cfg.max_queued_tokens}); retry later",
                retry,
            )
        if (
            cfg.ttft_slo_s is not None
            and self.step_model is not None
            and queue.num_queued_requests > 0
        ):
            ttft = estimate_ttft_s(queue, num_prompt_tokens, self.step_model, self.token_budget)
            if ttft > cfg.ttft_slo_s:
                shown = "unbounded" if math.isinf(ttft) else f"{ttft * 1000:.0f} ms"
                return Rejection(
                    "ttft_slo",
                    None,
                    f"server at capacity: estimated time to first token {shown} exceeds the "
                    f"{cfg.ttft_slo_s * 1000:.0f} ms target; retry later",
                    retry,
                )
        return None

    def _retry_after_s(self, queue: QueueSnapshot) -> int:
        """Seconds until the current queue has likely drained: 1..60."""
        if self.step_model is None:
            return 1
        ttft = estimate_ttft_s(queue, 0, self.step_model, self.token_budget)
        if math.isinf(ttft):
            return 5
        return max(1, min(60, math.ceil(ttft)))
