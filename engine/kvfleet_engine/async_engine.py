"""The asyncio front of the engine core, in the API process.

The engine core (scheduler, model runner, step loop) runs in its own process (`core.process`),
reached through a `CoreClient`. This side validates and sends each request once, turns each
step's new token ids into text (`OutputProcessor`: detokenizing, stop strings) and hands the
outputs to per-request asyncio queues, so HTTP handling and detokenizing never hold up the step
loop's GIL, and a slow client never stalls the batch. Budget changes, the capacity probe and
stats are named calls to the core, never closures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfleet_engine.client.output_processor import OutputProcessor
from kvfleet_engine.client.request_stream import EngineDeadError, RequestAbortedError, RequestStream
from kvfleet_engine.core.profile import PhaseProfile
from kvfleet_engine.core.records import AbortRequests, AddRequest, CoreFailed, FromCore, StepOutputs
from kvfleet_engine.core.validation import validate_request
from kvfleet_engine.metrics import EngineMetrics, FinishedRequestStats, IterationStats

if TYPE_CHECKING:
    from kvfleet_engine.client.core_client import CoreClient
    from kvfleet_engine.core.capacity import CapacityReport
    from kvfleet_engine.core.profile import ProcessProfile
    from kvfleet_engine.outputs import RequestOutput, SchedulerStats
    from kvfleet_engine.sampling import SamplingParams

log = logging.getLogger(__name__)

# The API process's phases (`core.profile`): parse (ASGI call -> route handler), request
# (handler -> AddRequest sent: tokenize, checks, admission), records (read and decode the
# core's records), outputs (new tokens -> outputs: detokenize, stop strings), dispatch
# (metrics, stream queues), chunks (format SSE chunks), write (hand chunks to the transport).
API_PHASES = ("parse", "request", "records", "outputs", "dispatch", "chunks", "write")


@dataclass
class _Timing:
    """Per-request bookkeeping for latency metrics."""

    num_prompt_tokens: int
    arrival_time: float
    num_tokens_seen: int = 0
    last_token_time: float | None = None


@dataclass
class _Counters:
    queued_tokens: int = 0  # prompt tokens of requests without a first token
    queued: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens


class AsyncEngine:
    """Serves requests through one engine-core process; all methods run on the event loop."""

    def __init__(
        self, client: CoreClient, tokenizer: Any, metrics: EngineMetrics | None = None
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_config = client.config.model
        self.metrics = metrics
        self.error: BaseException | None = None  # set when the core died
        # Called once with the error when the core dies (the server exits non-zero).
        self.on_core_died: Callable[[BaseException], None] | None = None
        self.processor = OutputProcessor(tokenizer)
        self.profile = PhaseProfile("api", API_PHASES)
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        self._counters = _Counters()
        self._num_running = 0
        self._started = False
        self._stopping = False
        self._core_error: str | None = None  # the reason the core sent before it exited

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start receiving the core's outputs (idempotent); call from inside the event loop."""
        if self._started:
            return
        self._started = True
        self.client.attach(
            asyncio.get_running_loop(), self._on_record, self._on_core_exit, self.profile
        )

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core; pending requests are failed."""
        self._stopping = True
        self.client.shutdown(timeout_s)
        self._fail_all(EngineDeadError("engine shut down"))

    @property
    def is_alive(self) -> bool:
        return self._started and self.error is None and not self._stopping

    # --- requests ----------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        stamps: dict[str, float] | None = None,
    ) -> RequestStream:
        """Send a request to the core; its outputs arrive on the returned stream.

        stamps: the caller's first-token stamps so far ("received", "handled"); the stream
        carries them on, adding the engine's and the core's.
        Raises ValueError naming the problem when the engine cannot run the request.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt = list(prompt_token_ids)
        validate_request(self.model_config, prompt, params)
        arrival = time.time() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, self.abort, stamps)
        self._streams[request_id] = stream
        self._timings[request_id] = _Timing(len(prompt), arrival)
        self._counters.queued[request_id] = len(prompt)
        self._counters.queued_tokens += len(prompt)
        self.processor.add_request(request_id, prompt, params, arrival)
        fields = {name: getattr(params, name) for name in params.__dataclass_fields__}
        if stamps is not None:
            stamps["sent"] = time.time()  # before the send: the pipe is the next hop's
        self.client.send(AddRequest(request_id, prompt, fields, priority, arrival))
        return stream

    def abort(self, request_ids: Sequence[str], reason: str | None = None) -> None:
        """Abort requests (frees their KV blocks); their streams end with an error that says
        `reason` where one is given (a drain's timeout), without output."""
        ids = [rid for rid in request_ids if rid in self._streams]
        if not ids:
            return
        now = time.time()
        finished = []
        for rid in ids:
            timing = self._timings.get(rid)
            if timing is not None:
                finished.append(FinishedRequestStats("abort", now - timing.arrival_time, None))
            stream = self._streams.get(rid)
            if stream is not None and not stream.finished:
                why = f": {reason}" if reason else ""
                stream.put(RequestAbortedError(f"request {rid} was aborted{why}"))
            self._forget(rid)
        self.client.send(AbortRequests(ids))
        if self.metrics is not None and finished:
            self.metrics.observe_iteration(IterationStats(finished=finished))

    def abort_all(self, reason: str | None = None) -> None:
        self.abort(list(self._streams), reason)

    # --- named calls to the core -------------------------------------------------------------

    async def measure_capacity(
        self, decode_batches: tuple[int, int], prefill_tokens: int
    ) -> CapacityReport:
        """The start-up self-benchmark, run in the core (it must be idle)."""
        report: CapacityReport = await self._call(
            "measure_capacity", decode_batches=list(decode_batches), prefill_tokens=prefill_tokens
        )
        return report

    async def set_token_budget(self, num_tokens: int) -> None:
        """Cap every step of the core at `num_tokens` (SLA mode)."""
        await self._call("set_token_budget", num_tokens=num_tokens)

    async def stats(self) -> SchedulerStats:
        stats: SchedulerStats = await self._call("stats")
        return stats

    async def core_profile(self) -> ProcessProfile:
        """The engine core's phase profile so far."""
        profile: ProcessProfile = await self._call("profile")
        return profile

    async def _call(self, name: str, **args: Any) -> Any:
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        return await self.client.call(name, **args)

    # --- state for admission, readiness and drain -------------------------------------------

    @property
    def num_queued_requests(self) -> int:
        """Requests sent without a first token yet."""
        return len(self._counters.queued)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens of those requests."""
        return self._counters.queued_tokens

    @property
    def num_running(self) -> int:
        """Requests in the core's running batch at its latest step."""
        return self._num_running

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # --- records from the core ---------------------------------------------------------------

    def _on_record(self, record: FromCore) -> None:
        if isinstance(record, StepOutputs):
            self._dispatch(record)
        elif isinstance(record, CoreFailed):
            self._core_error = record.error

    def _on_core_exit(self, exitcode: int | None) -> None:
        if self._stopping:
            return
        reason = self._core_error or "no reason given"
        error = EngineDeadError(f"engine core process exited (exit code {exitcode}): {reason}")
        log.error("%s", error)
        self.error = error
        self.client.fail_calls(error)
        self._fail_all(error)
        if self.on_core_died is not None:
            self.on_core_died(error)

    def _dispatch(self, step: StepOutputs) -> None:
        clock = time.perf_counter
        began = clock()
        stats = step.stats
        self._num_running = stats.num_running
        for request_id, reason in step.rejected.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(RequestAbortedError(f"the engine refused the request: {reason}"))
            self.processor.remove(request_id)
            self._forget(request_id)
        iteration = IterationStats()
        processing = clock()
        outputs, stopped = self.processor.process(step)
        processed = clock()
        if step.started:
            self._stamp_first_tokens(step)
        if stopped:  # ended by a stop string here: the core still runs them
            self.client.send(AbortRequests(stopped))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while this step ran
            self._account(out, iteration)
            stream.put(out)
            if out.finished:
                self._forget(out.request_id)
        if self.metrics is not None:
            self.metrics.observe_scheduler(stats)
            if iteration.ttfts_s or iteration.inter_token_latencies_s or iteration.finished:
                self.metrics.observe_iteration(iteration)
        profile = self.profile
        profile.add("outputs", processed - processing, len(outputs))
        profile.add("dispatch", (processing - began) + (clock() - processed))

    def _stamp_first_tokens(self, step: StepOutputs) -> None:
        dispatched = time.time()
        for request_id, started in step.started.items():
            stream = self._streams.get(request_id)
            if stream is None or stream.stamps is None:
                continue
            stream.stamps.update(
                added=started.added_time,
                scheduled=started.first_scheduled_time,
                token=step.timestamp,
                dispatched=dispatched,
            )

    def _account(self, out: RequestOutput, iteration: IterationStats) -> None:
        timing = self._timings.get(out.request_id)
        if timing is None:
            return
        m = out.metrics
        num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        new_tokens = num_tokens - timing.num_tokens_seen
        if new_tokens > 0 and m.last_token_time is not None:
            if timing.num_tokens_seen == 0:
                first = m.first_token_time or m.last_token_time
                iteration.ttfts_s.append(first - timing.arrival_time)
                self._dequeue(out.request_id)
                new_tokens -= 1
                timing.last_token_time = first
            if new_tokens > 0 and timing.last_token_time is not None:
                gap = (m.last_token_time - timing.last_token_time) / new_tokens
                iteration.inter_token_latencies_s.extend([gap] * new_tokens)
            timing.last_token_time = m.last_token_time
            timing.num_tokens_seen = num_tokens
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
            finished_at = m.finished_time or time.time()
            queued = None
            if m.first_scheduled_time is not None:
                queued = m.first_scheduled_time - timing.arrival_time
            iteration.finished.append(
                FinishedRequestStats(reason, finished_at - timing.arrival_time, queued)
            )

    def _dequeue(self, request_id: str) -> None:
        tokens = self._counters.queued.pop(request_id, None)
        if tokens is not None:
            self._counters.queued_tokens -= tokens

    def _forget(self, request_id: str) -> None:
        self._dequeue(request_id)
        self._streams.pop(request_id, None)
        self._timings.pop(request_id, None)
        self.processor.remove(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            stream.put(EngineDeadError(f"engine stopped: {exc}"))
            self._forget(rid)
