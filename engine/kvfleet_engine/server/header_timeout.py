"""uvicorn's HTTP protocol with a deadline on each request head (request line and headers): a
client that opens a connection and sends its head slowly or never finishes it (a slowloris) is
closed after `header_timeout_s`, instead of holding a connection, and a file descriptor, forever.

The deadline runs from the connection's open; on a kept-alive connection, from the first byte of
the next request (until that byte the connection is idle, and --keep-alive-timeout closes it), or
from the end of the previous response if that byte came while the response was being sent. A
request whose head is complete is never cut off by it, however long its body or response take.

uvicorn's "auto" protocol is httptools' when httptools imports, else h11's; `http_protocol`
subclasses the same one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvfleet_engine.server.request_head import (
    MAX_HEAD_BYTES,
    H11WithHeadChecks,
    HttpToolsWithHeadChecks,
)

log = logging.getLogger(__name__)


class HeadDeadline:
    """Closes a connection unless `stop()` follows `start()` within `timeout_s` seconds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self._timer is not None

    def start(self, transport: asyncio.Transport, client: tuple[str, int] | None) -> None:
        """Starts the deadline, unless it runs already (the earlier start counts)."""
        if self._timer is None and not transport.is_closing():
            self._timer = self.loop.call_later(self.timeout_s, self._expire, transport, client)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, transport: asyncio.Transport, client: tuple[str, int] | None) -> None:
        self._timer = None
        if transport.is_closing():
            return
        peer = f"{client[0]}:{client[1]}" if client else "a client"
        log.info(
            "closed the connection from %s: no complete request head within %g s "
            "(--header-timeout)",
            peer,
            self.timeout_s,
        )
        transport.close()


class H11WithHeadDeadline(H11WithHeadChecks):
    header_timeout_s: float  # set by `http_protocol`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_deadline = HeadDeadline(self.loop, self.header_timeout_s)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track_head()

    def handle_events(self) -> None:
        """Runs on every read and after every response: the head may have begun or ended."""
        super().handle_events()
        self._track_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_deadline.stop()
        super().connection_lost(exc)

    def _track_head(self) -> None:
        # h11 keeps a head's bytes unparsed until the head is complete; `their_state` is IDLE
        # only between requests, after the previous response ended.
        fresh = self.cycle is None
        head_begun = bool(self.conn.trailing_data[0])
        if self.conn.their_state is h11.IDLE and (fresh or head_begun):
            self.head_deadline.start(self.transport, self.client)
        else:
            self.head_deadline.stop()


class HttpToolsWithHeadDeadline(HttpToolsWithHeadChecks):
    header_timeout_s: float  # set by `http_protocol`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_deadline = HeadDeadline(self.loop, self.header_timeout_s)
        self._head_begun = False  # the parser has a head's first bytes, not its end

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_deadline.start(transport, self.client)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        if self.cycle is None or self.cycle.response_complete:  # else from its end
            self.head_deadline.start(self.transport, self.client)

    def on_headers_complete(self) -> None:
        self._head_begun = False
        self.head_deadline.stop()
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Bytes the parser took without beginning a message (a stray CRLF between requests,
        # which llhttp skips) stop uvicorn's keep-alive timer: time them as a head.
        idle = self.cycle is None or self.cycle.response_complete
        if data and idle and not self.head_deadline.running and not self.transport.is_closing():
            self.head_deadline.start(self.transport, self.client)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined head, begun while a response was sent: timed from the end of the
        # last response parsed before it (`self.cycle`), not of an earlier one.
        if self._head_begun and self.cycle.response_complete:
            self.head_deadline.start(self.transport, self.client)

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_deadline.stop()
        super().connection_lost(exc)


_WITH_HEAD_DEADLINE: dict[type[asyncio.Protocol], type[asyncio.Protocol]] = {
    H11Protocol: H11WithHeadDeadline,
    HttpToolsProtocol: HttpToolsWithHeadDeadline,
}


def http_protocol(
    header_timeout_s: float,
    base: type[asyncio.Protocol] = AutoHTTPProtocol,
    max_head_bytes: int = MAX_HEAD_BYTES,
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol `base` (the one its "auto" picks, by default) closing connections
    whose request head is not complete within `header_timeout_s`, and refusing heads over
    `max_head_bytes` (request_head.py); for `uvicorn.Config(http=)`."""
    if not header_timeout_s > 0:
        raise ValueError(
            f"header_timeout_s: expected a number of seconds > 0, got {header_timeout_s}"
        )
    subclass = _WITH_HEAD_DEADLINE[base]
    attributes = {"header_timeout_s": header_timeout_s, "max_head_bytes": max_head_bytes}
    return type(subclass.__name__, (subclass,), attributes)
