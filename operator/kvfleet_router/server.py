"""The router's HTTP server: aiohttp's, with two changes to each client connection.

A deadline on each request head (`--header-timeout`, Go's ReadHeaderTimeout, as `kvfleet
serve` has): a connection whose request line and headers are not complete `header_timeout_s`
after it opens, or after the first byte of its next request, is closed, so a client that sends
its head slowly or never finishes it (a slowloris) cannot hold a connection. A complete head is
never cut off, however slow its body or long its response; an idle kept-alive connection is the
keep-alive timeout's. A head begun while a response is being sent has its deadline from that
response's end. aiohttp's C parser does not tell where in one read a request ended, so a head
begun in the same read as the end of the request before it (pipelining) is timed from its next
bytes; until they come the connection counts as idle.

A request aiohttp cannot parse (bad framing, a header line over 8190 bytes, more than 128
headers) gets the OpenAI-style error body of the router's other 4xx answers and one log line,
not aiohttp's text/plain answer and a logged traceback; so does a body whose framing breaks
after its handler began reading it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader

log = logging.getLogger(__name__)


class RouterConnection(web.RequestHandler):
    """One client connection: aiohttp's request handler with a deadline on request heads."""

    __slots__ = ("_body", "_head_begun", "_head_timer", "_num_unanswered", "header_timeout_s")

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_begun = False  # bytes of a head came that no complete head has followed
        self._body: StreamReader = EMPTY_PAYLOAD  # the body of the last request parsed
        self._num_unanswered = 0  # requests parsed whose response has not ended

    @property
    def awaiting_head(self) -> bool:
        """Whether the head deadline runs."""
        return self._head_timer is not None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_head_deadline()

    def data_received(self, data: bytes) -> None:
        body = self._body
        in_body = not body.is_eof()
        num_parsed = self._request_count
        super().data_received(data)
        num_new = self._request_count - num_parsed
        if num_new:  # heads ended (or could not be parsed: the connection closes after a 400)
            self._num_unanswered += num_new
            message, self._body = self._messages[-1]
            self._head_begun = False
            self._stop_head_deadline()
            error = getattr(message, "exc", None)  # the parser's error
            if error is not None and not body.is_eof():
                # It broke the body being received: aiohttp only queues its 400 behind the
                # request, whose handler would wait for the rest of that body forever.
                failure = web.RequestPayloadError(parser_error(error))
                failure.__cause__ = error
                body.set_exception(failure)
        elif data and not in_body:
            self._head_begun = True
            if not self._num_unanswered:  # else from the end of the response being sent
                self._start_head_deadline()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._num_unanswered -= 1
            if self._head_begun and not self._num_unanswered:
                self._start_head_deadline()

    def drop_unread_body(self) -> None:
        """Close the connection as soon as the response being made is sent, without aiohttp's
        lingering read (up to 10 s) of the body its client has not finished: for a body that
        stalled (--body-timeout), whose rest would not come anyway."""
        self._lingering_time = 0.0

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_deadline()
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:  # a handler failed: the router's error, with its traceback
            return super().handle_error(request, status, exc, message)
        # aiohttp's parser refused the request (its only 4xx): the client's error.
        detail = parser_error(exc)
        log.info("answered %d to %s: malformed HTTP request: %s", status, self.peer(), detail)
        body = {
            "message": f"malformed HTTP request: {detail}",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        response = web.json_response({"error": body}, status=status)
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        error = kwargs.get("exc_info")
        if isinstance(error, web.RequestPayloadError):  # the body's framing broke: the client's
            detail = parser_error(error.__cause__ or error)
            log.info("closed the connection from %s: bad request body: %s", self.peer(), detail)
            return
        super().log_exception(*args, **kwargs)

    def _start_head_deadline(self) -> None:
        """Starts the deadline, unless it runs already (the earlier start counts)."""
        if self._head_timer is None and self.transport is not None:
            loop = asyncio.get_running_loop()
            self._head_timer = loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        log.info(
            "closed the connection from %s: no complete request head within %g s "
            "(--header-timeout)",
            self.peer(),
            self.header_timeout_s,
        )
        self.force_close()

    def peer(self) -> str:
        """The client's host:port, for log lines."""
        peer = self.peername
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a client"


def parser_error(error: BaseException | None) -> str:
    """What aiohttp's HTTP parser found wrong, on one line (its messages point at the bad byte
    on lines of their own)."""
    if isinstance(error, LineTooLong):
        return f"a request line or header is longer than {error.args[1]} bytes"
    if isinstance(error, HttpProcessingError):
        lines = (line.strip() for line in error.message.splitlines())
        return " ".join(line for line in lines if line and line != "^")
    return str(error)


class RouterServer(web.Server):
    """aiohttp's server, making a RouterConnection for each connection."""

    def __init__(self, made: web.Server, header_timeout_s: float) -> None:
        super().__init__(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            **made._kwargs,  # the RequestHandler settings the runner and the app gave
        )
        self.header_timeout_s = header_timeout_s

    def __call__(self) -> web.RequestHandler:
        return RouterConnection(
            self, header_timeout_s=self.header_timeout_s, loop=self._loop, **self._kwargs
        )


class RouterRunner(web.AppRunner):
    """An AppRunner whose server is a RouterServer."""

    __slots__ = ("_header_timeout_s",)

    def __init__(self, app: web.Application, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        return RouterServer(await super()._make_server(), self._header_timeout_s)
