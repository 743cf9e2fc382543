"""One engine request's outputs in the API process, as an async iterator, and the errors that
end it (the engine core stopped; the server aborted the request)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet_engine.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine core stopped; no request can be served any more."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (e.g. the drain timeout ran out) before it finished."""


class RequestStream:
    """Outputs of one engine request, as an async iterator; `close()` aborts it if unfinished."""

    def __init__(
        self,
        request_id: str,
        abort: Callable[[Sequence[str]], None],  # the engine's: aborts requests by id
        stamps: dict[str, float] | None = None,
    ) -> None:
        self.request_id = request_id
        self.finished = False
        # The way to the first token (`core.profile.FIRST_TOKEN_HOPS`), stamped as it goes.
        self.stamps = stamps
        self._abort = abort
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
            self._abort([self.request_id])

    def put(self, item: RequestOutput | BaseException) -> None:
        """The engine's side: the next output, or the error that ends the stream."""
        self._queue.put_nowait(item)
