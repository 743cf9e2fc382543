"""`EngineCore`: the scheduler, the model runner and the step that drives them; no tokenizer.

It is what runs in the engine-core process (`core.process`), and the base of the in-process
`LLMEngine`, which adds text. A step advances every running request by one token
(`advance`); `step_outputs` packs what it produced into the record that crosses to the API
process: per request, only the tokens it got in this step. Under pipeline parallelism a step
advances the requests of the oldest of the micro-batches in flight (one per stage).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable

from kvfleet_engine.config import EngineConfig, ModelConfig
from kvfleet_engine.core.profile import PhaseProfile
from kvfleet_engine.core.records import Finished, Started, StepOutputs
from kvfleet_engine.core.validation import check_priority, validate_request
from kvfleet_engine.kv_cache import KVCacheManager
from kvfleet_engine.model_runner import LaunchedStep, ModelRunner
from kvfleet_engine.outputs import SchedulerStats
from kvfleet_engine.request import Request, RequestStatus
from kvfleet_engine.sampling import SamplingParams
from kvfleet_engine.scheduler import Scheduler
from kvfleet_engine.step import SchedulerOutput

log = logging.getLogger(__name__)

# The step's phases the core's profile times (`core.process` adds its loop's: idle, commands,
# send): schedule, launch (build inputs, queue the forward pass), collect (wait for the device,
# samples to Python), update (append tokens, finish requests), output (the step's record).
STEP_PHASES = ("schedule", "launch", "collect", "update", "output")


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.config = config
        self.model_config: ModelConfig = config.model
        self.model_runner = runner
        self.kv_cache = KVCacheManager(
            runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.num_micro_batches = config.parallel.pipeline_parallel_size
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache, config.model.max_model_len, self.num_micro_batches
        )
        # The step launched but not collected yet (async scheduling).
        self.in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        # Pipeline parallelism: the micro-batches in flight, oldest first (at most one per
        # stage), and the most there were at once.
        self.micro_batches: deque[tuple[SchedulerOutput, LaunchedStep]] = deque()
        self.max_micro_batches_in_flight = 0
        # request id -> output tokens already reported by step_outputs().
        self._num_reported: dict[str, int] = {}
        # request id -> when add_request ran (time.time()), until its first token is reported.
        self._added_time: dict[str, float] = {}
        self.profile = PhaseProfile("core", (*STEP_PHASES, "idle", "commands", "send"))

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        return cls(config, ModelRunner(config))

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request. Raises ValueError naming the problem for bad input (TypeError for a
        priority that is not an integer; token ids arrive as ints: `LLM` converts its callers',
        the server parses its own)."""
        validate_request(self.model_config, prompt_token_ids, params)
        check_priority(priority)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.model_config.eos_token_ids,
            priority=priority,
            arrival_time=time.time() if arrival_time is None else arrival_time,
        )
        self.scheduler.add(request)
        self._added_time[request_id] = time.time()
        return request

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Drop requests (running or waiting) and free their blocks; they produce no output."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish(ids, RequestStatus.FINISHED_ABORTED)
        for request_id in ids:
            self._num_reported.pop(request_id, None)
            self._added_time.pop(request_id, None)
        if self.in_flight is not None and not self.scheduler.has_unfinished_requests():
            # Every request of the step in flight has gone: drop its tokens now, or the next
            # request's first step would collect them and report nothing (an extra round).
            self._collect_in_flight()
        if self.micro_batches and not self.scheduler.has_unfinished_requests():
            self._drop_micro_batches()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        """The scheduler's snapshot, with the model runner's own counter."""
        steps = self.model_runner.shared_prefix_steps_total
        return dataclasses.replace(self.scheduler.stats(), shared_prefix_steps_total=steps)

    # ---- the step ---------------------------------------------------------------------------

    def advance(self) -> list[Request]:
        """Advance every running request by one step. Returns the requests that got a token
        (finished or not); with async scheduling, those of the step launched last time."""
        if self.num_micro_batches > 1:
            return self._advance_micro_batches()
        if self.in_flight is None:
            self.in_flight = self._launch_next()
        progressed = []
        if not self.config.scheduler.async_scheduling or self._needs_host_tokens():
            progressed = self._collect_in_flight()  # the next step is built from known tokens
        launched = self._launch_next()
        progressed += self._collect_in_flight()
        self.in_flight = launched
        if launched is not None and not self.scheduler.has_unfinished_requests():
            self._collect_in_flight()  # every request it ran has ended: drop its tokens
        return progressed

    def _advance_micro_batches(self) -> list[Request]:
        """Pipeline parallelism: launch steps until one per stage is in flight (or nothing more
        can be scheduled: every other request waits for its token), then collect the oldest."""
        batches = self.micro_batches
        while len(batches) < self.num_micro_batches:
            launched = self._launch_next()
            if launched is None:
                break
            batches.append(launched)
        self.max_micro_batches_in_flight = max(self.max_micro_batches_in_flight, len(batches))
        if not batches:
            return []
        self.in_flight = batches.popleft()
        progressed = self._collect_in_flight()
        if batches and not self.scheduler.has_unfinished_requests():
            self._drop_micro_batches()
        return progressed

    def _drop_micro_batches(self) -> None:
        """Every request has ended: wait for the steps still in flight, drop their tokens."""
        while self.micro_batches:
            self.in_flight = self.micro_batches.popleft()
            self._collect_in_flight()

    def step_outputs(self) -> StepOutputs:
        """One step, as the record the API process receives: each request's new tokens."""
        progressed = self.advance()
        began = time.perf_counter()
        request_ids: list[str] = []
        new_token_ids: list[list[int]] = []
        new_logprobs: dict[str, list[dict[int, float]]] = {}
        started: dict[str, Started] = {}
        finished: dict[str, Finished] = {}
        reported = self._num_reported
        now = time.time()
        for request in progressed:
            request_id = request.request_id
            num_before = reported.get(request_id, 0)
            if num_before == request.num_output_tokens:
                continue  # listed twice in one step: its tokens are out already
            request_ids.append(request_id)
            new_token_ids.append(request.output_token_ids[num_before:])
            if request.params.logprobs is not None:
                new_logprobs[request_id] = request.output_logprobs[num_before:]
            if num_before == 0:
                metrics = request.metrics
                started[request_id] = Started(
                    max(request.num_cached_tokens, 0),
                    metrics.first_scheduled_time or now,
                    self._added_time.pop(request_id, now),
                )
            if request.is_finished:
                reported.pop(request_id, None)
                finished[request_id] = Finished(
                    request.status.finish_reason or "stop",
                    request.stop_reason,
                    request.metrics.finished_time or now,
                )
            else:
                reported[request_id] = request.num_output_tokens
        timestamp = progressed[0].metrics.last_token_time if progressed else None
        outputs = StepOutputs(
            request_ids=request_ids,
            new_token_ids=new_token_ids,
            timestamp=timestamp or now,
            stats=self.scheduler.stats(),
            new_logprobs=new_logprobs,
            started=started,
            finished=finished,
        )
        self.profile.add("output", time.perf_counter() - began)
        return outputs

    def _launch_next(self) -> tuple[SchedulerOutput, LaunchedStep] | None:
        clock = time.perf_counter
        began = clock()
        scheduled = self.scheduler.schedule()
        scheduled_at = clock()
        launched = self.model_runner.launch(scheduled)
        profile = self.profile
        profile.add("schedule", scheduled_at - began)
        if not scheduled.requests:
            return None
        profile.add("launch", clock() - scheduled_at)
        return scheduled, launched

    def _collect_in_flight(self) -> list[Request]:
        if self.in_flight is None:
            return []
        scheduled, launched = self.in_flight
        self.in_flight = None
        clock = time.perf_counter
        began = clock()
        result = self.model_runner.collect(launched)
        collected_at = clock()
        progressed = self.scheduler.update(scheduled, result)
        self.profile.add("collect", collected_at - began)
        self.profile.add("update", clock() - collected_at)
        return progressed

    def _needs_host_tokens(self) -> bool:
        """A running request's next step needs its latest token on the host (penalties count
        the output tokens when the step is built)."""
        return any(request.params.has_penalties for request in self.scheduler.running)
