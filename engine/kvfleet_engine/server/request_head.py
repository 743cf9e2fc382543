"""uvicorn's HTTP protocols, changed in what they do with a request head (request line and
headers) before the app sees it:

- a head over `max_head_bytes` gets a 431 and its connection is closed. uvicorn's httptools
  protocol had no limit (a 100 MB header was read whole, and answered), its h11 one refused
  16 KiB of incomplete head with a plain-text 400;
- an `Upgrade` header the server does not act on (`Upgrade: h2c`, which `curl --http2` sends over
  plain http, or `websocket` without a WebSocket library) is ignored: the request is served over
  HTTP/1.1. httptools skips the body of any request asking to upgrade, so the app got an empty
  one, and the rest of that read (a pipelined request) was lost;
- a request the parser cannot read gets an OpenAI-style JSON error, not uvicorn's text/plain
  "Invalid HTTP request received.".

header_timeout.py builds on these classes; its `http_protocol` gives the one to serve with.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

import h11
import httptools
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvfleet_engine.server.errors import error_body

log = logging.getLogger(__name__)

# Four times the 16 KiB of Node's and uvicorn's h11 defaults, twice nginx's 32 KiB: long
# cookies and bearer tokens fit, and a connection holds at most this much (plus one read) of
# unfinished head.
MAX_HEAD_BYTES = 64 * 1024


def head_size(target: bytes, headers: Iterable[tuple[bytes, bytes]]) -> int:
    """Bytes of a head's target and header lines ("name: value\\r\\n")."""
    return len(target) + sum(len(name) + len(value) + 4 for name, value in headers)


def error_bytes(
    status: int, message: str, default_headers: list[tuple[bytes, bytes]], code: str | None
) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-style JSON error that closes the connection,
    written by the protocol itself (no request reached the app)."""
    error = error_body(message, type_="invalid_request_error", code=code)
    body = json.dumps(error, separators=(",", ":")).encode()
    lines = [b"HTTP/1.1 %d %s" % (status, HTTPStatus(status).phrase.encode())]
    lines += [name + b": " + value for name, value in default_headers]
    lines += [
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _refuse_head(protocol: H11Protocol | HttpToolsProtocol, max_head_bytes: int) -> None:
    log.info("refused a request head over %d bytes from %s", max_head_bytes, _peer(protocol))
    message = (
        f"request line and headers exceed {max_head_bytes:,} bytes, the server's limit: send "
        "fewer or shorter headers"
    )
    _answer(protocol, 431, message, "request_head_too_large")


def _refuse_malformed(protocol: H11Protocol | HttpToolsProtocol, reason: str) -> None:
    log.info("answered 400 to %s: malformed HTTP request: %s", _peer(protocol), reason)
    _answer(protocol, 400, f"malformed HTTP request: {reason[:200]}", "malformed_request")


def _answer(
    protocol: H11Protocol | HttpToolsProtocol, status: int, message: str, code: str
) -> None:
    if protocol.transport.is_closing():
        return
    default_headers = protocol.server_state.default_headers
    protocol.transport.write(error_bytes(status, message, default_headers, code))
    protocol.transport.close()


def _peer(protocol: H11Protocol | HttpToolsProtocol) -> str:
    client = protocol.client
    return f"{client[0]}:{client[1]}" if client else "a client"


class _HeadTooLarge(Exception):
    """Raised in a parser callback to stop httptools' parser."""


class _BoundedConnection(h11.Connection):
    """h11's server side, refusing a complete request head over `max_head_bytes` too (h11 bounds
    only a head it is still waiting the end of); `refused` keeps the error for the answer."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.refused: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refused = exc
            raise
        if isinstance(event, h11.Request):
            if head_size(event.target, event.headers) > self.max_head_bytes:
                self.refused = h11.RemoteProtocolError("request head too large", 431)
                raise self.refused
        return event


class H11WithHeadChecks(H11Protocol):
    max_head_bytes = MAX_HEAD_BYTES
    conn: _BoundedConnection

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _BoundedConnection(self.max_head_bytes)

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this on every error of h11 (or of `_BoundedConnection`)."""
        refused = self.conn.refused
        if refused is not None and refused.error_status_hint == 431:
            _refuse_head(self, self.max_head_bytes)
        else:
            _refuse_malformed(self, str(refused) if refused is not None else msg)

    def _unsupported_upgrade_warning(self) -> None:
        """h11 serves the request over HTTP/1.1 already: nothing to warn about."""


class HttpToolsWithHeadChecks(HttpToolsProtocol):
    max_head_bytes = MAX_HEAD_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # httptools keeps an unfinished header line to itself: the head is measured by whole
        # reads while it is unfinished, and exactly once it is complete.
        self._unfinished_head_bytes: int | None = None  # None: no head being parsed
        self._head_began_in_read = False
        self._head_too_large = False  # why on_headers_complete stopped the parser
        self._upgrade_ignored = False  # this head asked to upgrade: it is parsed again without

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with the head bounded and an upgrade request parsed again as HTTP/1.1."""
        self._unset_keepalive_if_required()
        self._head_began_in_read = False
        try:
            self._feed(data)
        except httptools.HttpParserError as exc:
            if self._head_too_large:
                _refuse_head(self, self.max_head_bytes)
            else:
                _refuse_malformed(self, str(exc))
            return
        if self._unfinished_head_bytes is not None and not self._head_began_in_read:
            self._unfinished_head_bytes += len(data)  # the whole read went to the head
            if self._unfinished_head_bytes > self.max_head_bytes:
                _refuse_head(self, self.max_head_bytes)

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            if not self._upgrade_ignored:  # a WebSocket the server takes, or CONNECT
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                return
            # httptools skipped the body, taking it for another protocol's bytes: parse the
            # head again without its Upgrade header, then the body and what follows.
            rest = data[upgrade.args[0] :]
            head = self._head_without_upgrade()
            self.parser = httptools.HttpRequestParser(self)
            try:  # as uvicorn sets its own parser (httptools >= 0.6.3)
                self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
            except AttributeError:
                pass
            self.parser.feed_data(head + rest)

    def _head_without_upgrade(self) -> bytes:
        version = self.parser.get_http_version().encode()
        lines = [self.parser.get_method() + b" " + self.url + b" HTTP/" + version]
        lines += [name + b": " + value for name, value in self.headers if name != b"upgrade"]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._unfinished_head_bytes = 0
        self._head_began_in_read = True
        self._upgrade_ignored = False

    def on_headers_complete(self) -> None:
        self._unfinished_head_bytes = None
        if head_size(self.url, self.headers) > self.max_head_bytes:
            self._head_too_large = True
            raise _HeadTooLarge  # stops the parser; data_received answers
        self._upgrade_ignored = (
            self.parser.should_upgrade()
            and not self._should_upgrade()
            and self.parser.get_method() != b"CONNECT"
        )
        if not self._upgrade_ignored:  # else served once parsed again
            super().on_headers_complete()

    def on_message_complete(self) -> None:
        if not self._upgrade_ignored:
            super().on_message_complete()
