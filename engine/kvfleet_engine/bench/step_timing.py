"""Where an offline run's time goes, step by step: host time launching steps and waiting for
their tokens, and on a GPU the device's own timeline — busy in steps with prompt tokens, busy in
pure decode steps, and idle between steps (the host was late: the bubbles async scheduling is
meant to remove). Wraps a ModelRunner's launch/collect for the duration of a `with` block."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch


@dataclass
class _DeviceStep:
    start: torch.cuda.Event
    end: torch.cuda.Event
    has_prompt_tokens: bool


@dataclass
class StepTimer:
    runner: Any
    steps: int = 0
    launch_s: float = 0.0
    wait_s: float = 0.0
    _device_steps: list[_DeviceStep] = field(default_factory=list)

    def __enter__(self) -> StepTimer:
        self._launch, self._collect = self.runner.launch, self.runner.collect
        self._on_gpu = self.runner.device.type == "cuda"
        self.runner.launch, self.runner.collect = self._timed_launch, self._timed_collect
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.runner.launch, self.runner.collect = self._launch, self._collect

    def _timed_launch(self, scheduled: Any) -> Any:
        if not scheduled.requests:
            return self._launch(scheduled)
        begin = time.perf_counter()
        start = end = None
        if self._on_gpu:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        try:
            return self._launch(scheduled)
        finally:
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                prompt = scheduled.num_batched_tokens > len(scheduled.requests)
                self._device_steps.append(_DeviceStep(start, end, prompt))
            self.launch_s += time.perf_counter() - begin
            self.steps += 1

    def _timed_collect(self, step: Any) -> Any:
        begin = time.perf_counter()
        try:
            return self._collect(step)
        finally:
            self.wait_s += time.perf_counter() - begin

    def device_seconds(self) -> dict[str, float]:
        """Device busy time in steps with prompt tokens / pure decode steps, idle time between
        consecutive steps, and the step counts (empty on the CPU)."""
        if not self._device_steps:
            return {}
        torch.cuda.synchronize()
        totals = {"prompt_steps_busy_s": 0.0, "decode_steps_busy_s": 0.0, "idle_s": 0.0}
        counts = {"prompt_steps": 0, "decode_steps": 0}
        previous = None
        for step in self._device_steps:
            busy = step.start.elapsed_time(step.end) / 1e3
            kind = "prompt_steps" if step.has_prompt_tokens else "decode_steps"
            totals[f"{kind}_busy_s"] += busy
            counts[kind] += 1
            if previous is not None:
                totals["idle_s"] += max(previous.end.elapsed_time(step.start) / 1e3, 0.0)
            previous = step
        return {**totals, **{k: float(v) for k, v in counts.items()}}
