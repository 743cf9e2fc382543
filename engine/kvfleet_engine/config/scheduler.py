"""The scheduler's settings: how much one step computes, and whether steps overlap."""

from __future__ import annotations

from dataclasses import dataclass


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
