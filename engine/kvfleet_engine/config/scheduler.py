"""The scheduler's settings: how much one step computes, and whether steps overlap."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_engine.config.checks import check, check_switch, is_int


@dataclass(frozen=True)
class SchedulerConfig:
    # Most requests computed in one step.
    max_num_seqs: int = 256
    # Most tokens computed in one step (decodes plus prefill chunks).
    max_num_batched_tokens: int = 8192
    # Schedule and launch step n+1 while the GPU computes step n: each decode's input token is
    # taken on the device from step n's samples, and the host bookkeeping of step n overlaps
    # step n+1 (a request that stops at step n costs one discarded token).
    async_scheduling: bool = True


def check_scheduler(scheduler: SchedulerConfig) -> None:
    """Each setting's type and range."""
    num_seqs, num_tokens = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    check(is_int(num_seqs) and num_seqs >= 1, "max_num_seqs", num_seqs, "an integer >= 1")
    check(is_int(num_tokens), "max_num_batched_tokens", num_tokens, "an integer")
    check(
        num_tokens >= num_seqs,
        "max_num_batched_tokens",
        num_tokens,
        f">= max_num_seqs ({num_seqs})",
    )
    check_switch("async_scheduling", scheduler.async_scheduling)
