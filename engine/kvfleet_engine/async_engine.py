"""The asyncio front of the synchronous `LLMEngine`.

One dedicated thread owns the engine and runs its step loop; the event loop never calls the
engine directly. Requests and aborts cross to that thread through a command queue; each step's
outputs cross back in one `call_soon_threadsafe` and land in per-request asyncio queues. So HTTP
handling never stalls decoding, and a slow client never stalls the batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvfleet_engine.metrics import EngineMetrics, FinishedRequestStats, IterationStats
from kvfleet_engine.server.admission import QueueSnapshot

if TYPE_CHECKING:
    from kvfleet_engine.engine import LLMEngine
    from kvfleet_engine.outputs import RequestOutput
    from kvfleet_engine.sampling import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")

_IDLE_POLL_S = 0.05  # how long the idle engine thread waits for a command before re-checking


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an exception; no request can be served any more."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (e.g. the drain timeout ran out) before it finished."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future[Any]


@dataclass
class _Timing:
    """Per-request bookkeeping on the event-loop thread, for latency metrics."""

    num_prompt_tokens: int
    arrival_time: float
    num_tokens_seen: int = 0
    last_token_time: float | None = None


class RequestStream:
    """Outputs of one engine request, as an async iterator; `close()` aborts it if unfinished."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            # Coalesce outputs that piled up while the consumer was busy: outputs are
            # cumulative, so the newest one carries everything.
            while not item.finished and not self._queue.empty():
                nxt = self._queue.get_nowait()
                if isinstance(nxt, BaseException):
                    self.finished = True
                    raise nxt
                item = nxt
            self.finished = item.finished
            yield item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort([self.request_id])

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)


@dataclass
class _Counters:
    queued_tokens: int = 0  # prompt tokens of requests without a first token
    queued: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens


class AsyncEngine:
    """Drives one `LLMEngine` on its own thread; all public methods run on the event loop."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.error: BaseException | None = None  # set when the engine thread died
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        self._counters = _Counters()
        self._num_running = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent); call from inside the event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; pending requests are failed."""
        if self._thread is None:
            return
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout_s)
        self._thread = None
        for stream in list(self._streams.values()):
            stream._put(EngineDeadError("engine shut down"))
        self._streams.clear()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # --- requests ----------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it.

        Raises ValueError (the engine's message) when the engine refuses the request.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        loop = asyncio.get_running_loop()
        arrival = time.time() if arrival_time is None else arrival_time
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._timings[request_id] = _Timing(len(prompt_token_ids), arrival)
        self._counters.queued[request_id] = len(prompt_token_ids)
        self._counters.queued_tokens += len(prompt_token_ids)
        accepted: asyncio.Future[None] = loop.create_future()
        self._commands.put(
            _Add(request_id, list(prompt_token_ids), params, priority, arrival, accepted)
        )
        try:
            await accepted
        except ValueError:  # refused by the engine: it holds nothing
            self._forget(request_id)
            raise
        except BaseException:  # the client went away, or the engine failed: it may hold it
            self._forget(request_id)
            self._commands.put(_Abort([request_id]))
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (frees their KV blocks); their streams end without output."""
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
                stream._put(RequestAbortedError(f"request {rid} was aborted"))
            self._forget(rid)
        self._commands.put(_Abort(ids))
        if self.metrics is not None and finished:
            self.metrics.observe_iteration(IterationStats(finished=finished))

    def abort_all(self) -> None:
        self.abort(list(self._streams))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._commands.put(_Call(fn, done))
        return await done

    # --- state for admission, readiness and drain -------------------------------------------

    def queue_snapshot(self) -> QueueSnapshot:
        return QueueSnapshot(
            num_queued_requests=len(self._counters.queued),
            num_queued_tokens=self._counters.queued_tokens,
            num_running=self._num_running,
        )

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # --- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                busy = engine.has_unfinished_requests()
                if self._apply_commands(block=not busy) and not engine.has_unfinished_requests():
                    # An abort emptied the engine: no step will report the freed blocks.
                    self._post(self._observe_stats, engine.stats())
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                stats = engine.stats()
                self._post(self._dispatch, outputs, stats, time.time())
        except BaseException as exc:  # the loop must report, not vanish
            log.exception("engine loop died")
            self.error = exc
            self._post(self._fail_all, exc)

    def _apply_commands(self, block: bool) -> int:
        """Apply every queued command (when idle, first wait briefly for one); how many."""
        applied = 0
        try:
            get = self._commands.get
            command = get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
            while True:
                self._apply(command)
                applied += 1
                command = self._commands.get_nowait()
        except queue.Empty:
            return applied

    def _apply(self, command: _Add | _Abort | _Call | None) -> None:
        engine = self.engine
        if command is None:
            return
        if isinstance(command, _Add):
            try:
                engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    priority=command.priority,
                    arrival_time=command.arrival_time,
                )
            except ValueError as exc:  # the request's fault: the client gets a 400
                self._post(_resolve, command.accepted, None, exc)
            except Exception as exc:  # the engine's fault: fail this request, keep serving
                log.exception("add_request(%s) failed", command.request_id)
                self._post(_resolve, command.accepted, None, exc)
            else:
                self._post(_resolve, command.accepted, None, None)
        elif isinstance(command, _Abort):
            engine.abort_request(command.request_ids)
        else:
            try:
                result = command.fn(engine)
            except Exception as exc:
                self._post(_resolve, command.done, None, exc)
            else:
                self._post(_resolve, command.done, result, None)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # --- event-loop side -------------------------------------------------------------------

    def _observe_stats(self, stats: Any) -> None:
        self._num_running = stats.num_running
        if self.metrics is not None:
            self.metrics.observe_scheduler(stats)

    def _dispatch(self, outputs: list[RequestOutput], stats: Any, now: float) -> None:
        self._num_running = stats.num_running
        iteration = IterationStats()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while this step ran
            self._account(out, iteration)
            stream._put(out)
            if out.finished:
                self._forget(out.request_id)
        if self.metrics is not None:
            self.metrics.observe_scheduler(stats)
            self.metrics.observe_iteration(iteration)

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

    def _fail_all(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            stream._put(EngineDeadError(f"engine stopped: {exc}"))
            self._forget(rid)


def _resolve(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
