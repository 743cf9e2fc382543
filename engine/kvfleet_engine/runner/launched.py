"""The records between the model runner's launch of a step and its collection: the step queued
on the device (`LaunchedStep`), its span on the device timeline (`DeviceSpan`), the host buffers
its samples land in, and what collecting it hands the scheduler (`runner_output`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvfleet_engine.outputs import ModelRunnerOutput

# Sampled-token logprob [rows], top ids and top logprobs [rows, n], as the sampler returns them.
Logprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device; its samples reach host memory when `done` fires."""

    # Request id of each sampling row, in row order.
    request_ids: list[str]
    # Top-n logprobs wanted per sampling row (None: none).
    num_logprobs: list[int | None]
    # [rows] int64 sampled tokens, in host memory once `done` (None: nothing was sampled).
    token_ids: torch.Tensor | None
    # Sampled-token logprob [rows], top ids and top logprobs [rows, n] (None: not asked).
    logprobs: Logprobs | None
    # Recorded after the copies to the host (None on the CPU: already there).
    done: torch.cuda.Event | None
    # Pipeline parallelism: the receives of the samples from the last stage, to wait for.
    receiving: tuple[Any, ...] = ()


# A step with nothing to run or nothing to sample (its collect hands back no tokens).
NOTHING_LAUNCHED = LaunchedStep([], [], None, None, None)


@dataclass
class DeviceSpan:
    """A launched step's span on the device, between two timing events (`ModelRunner.timeline`)."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    has_prompt_tokens: bool


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Queue a copy of a device tensor into fresh pinned host memory."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def sample_buffers(
    num_logprobs: list[int | None], device: torch.device
) -> tuple[torch.Tensor, Logprobs | None]:
    """Empty buffers for a step's samples as the sampler returns them: [rows] int64 token ids,
    and where any row asks for logprobs, the sampled-token logprob [rows] and the top
    max(n, 1) ids and logprobs [rows, top] (a pipeline's first stage receives them into these)."""
    rows = len(num_logprobs)
    token_ids = torch.empty(rows, dtype=torch.int64, device=device)
    wanted = [num for num in num_logprobs if num is not None]
    if not wanted:
        return token_ids, None
    top = max(max(wanted), 1)
    logprobs = (
        torch.empty(rows, dtype=torch.float32, device=device),
        torch.empty((rows, top), dtype=torch.int64, device=device),
        torch.empty((rows, top), dtype=torch.float32, device=device),
    )
    return token_ids, logprobs


def runner_output(step: LaunchedStep) -> ModelRunnerOutput:
    """A collected step's samples as Python values: each row's token, and its sampled token's
    logprob beside the top n it asked for (its samples in host memory)."""
    if step.token_ids is None:
        return ModelRunnerOutput(sampled_token_ids={}, logprobs={})
    token_ids = step.token_ids.tolist()
    request_ids = step.request_ids
    logprobs: dict[str, dict[int, float]] = {}
    if step.logprobs is not None:
        sampled_logprobs, top_ids, top_values = (t.tolist() for t in step.logprobs)
        for row, num in enumerate(step.num_logprobs):
            if num is None:
                continue
            entry = dict(zip(top_ids[row][:num], top_values[row][:num], strict=True))
            entry[token_ids[row]] = sampled_logprobs[row]
            logprobs[request_ids[row]] = entry
    return ModelRunnerOutput(
        sampled_token_ids=dict(zip(request_ids, token_ids, strict=True)), logprobs=logprobs
    )
