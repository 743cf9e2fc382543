"""Where an offline run's time goes, step by step: host time launching steps and waiting for
their tokens (the engine core's own phases, `core.profile`), and on a GPU the device's own
timeline (the runner's `timeline`) — busy in steps with prompt tokens, busy in pure decode
steps, and idle between steps (the host was late: the bubbles async scheduling is meant to
remove). Covers the duration of a `with` block."""

from __future__ import annotations

from types import TracebackType

import torch

from kvfleet_engine.core.engine_core import EngineCore
from kvfleet_engine.core.profile import ProcessProfile
from kvfleet_engine.runner.launched import DeviceSpan


class StepTimer:
    """`with StepTimer(engine) as timer: ...`, then `steps`, `launch_s` and `wait_s` (host
    seconds launching steps with requests and collecting their tokens) and `device_seconds()`."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.steps = 0
        self.launch_s = 0.0
        self.wait_s = 0.0
        self._spans: list[DeviceSpan] = []
        self._before: ProcessProfile | None = None

    def __enter__(self) -> StepTimer:
        self._spans = []
        self.engine.model_runner.timeline = self._spans
        self._before = self.engine.profile.snapshot()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.engine.model_runner.timeline = None
        assert self._before is not None
        before, after = self._before.phases, self.engine.profile.snapshot().phases
        self.launch_s = after["launch"][0] - before["launch"][0]
        self.steps = int(after["launch"][1] - before["launch"][1])
        self.wait_s = after["collect"][0] - before["collect"][0]

    def device_seconds(self) -> dict[str, float]:
        """Device busy time in steps with prompt tokens / pure decode steps, idle time between
        consecutive steps, and the step counts (empty on the CPU)."""
        if not self._spans:
            return {}
        torch.cuda.synchronize()
        totals = {"prompt_steps_busy_s": 0.0, "decode_steps_busy_s": 0.0, "idle_s": 0.0}
        counts = {"prompt_steps": 0, "decode_steps": 0}
        previous = None
        for span in self._spans:
            busy = span.start.elapsed_time(span.end) / 1e3
            kind = "prompt_steps" if span.has_prompt_tokens else "decode_steps"
            totals[f"{kind}_busy_s"] += busy
            counts[kind] += 1
            if previous is not None:
                totals["idle_s"] += max(previous.end.elapsed_time(span.start) / 1e3, 0.0)
            previous = span
        return {**totals, **{k: float(v) for k, v in counts.items()}}
