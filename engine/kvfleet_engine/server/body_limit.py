"""`BodyLimit`: requests whose body exceeds the limit get 413 before the app parses anything;
a body under a Content-Encoding (gzip, br, ...) gets 415: it is not decompressed, and read as
JSON it would only be a confusing 400; a body whose next bytes do not come within the idle
timeout (a client that stalls after its headers) gets 408 and its connection is closed. The
timeout bounds each wait, not the whole body (as nginx's client_body_timeout): a client that
sends a byte just within it every time holds its connection until the limit's bytes came.

A declared Content-Length over the limit is refused without reading the body; any other body is
read up to the limit and refused as soon as it passes it. The body is read here, whole, then
replayed to the app, which would buffer it whole anyway.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfleet_engine.server.errors import error_body, error_response

# The default: a prompt at a 128k-token context fits, as token ids (~7 bytes each) or as
# JSON-escaped text; a batch of prompts beyond it goes in several requests.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# The longest wait for a body's next bytes: nginx's client_body_timeout. A client on a slow link
# still sends something every few seconds; one that sends nothing for a minute has stalled.
DEFAULT_BODY_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, idle_timeout_s: float) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_request_body_bytes: must be >= 1, got {max_bytes}")
        if not idle_timeout_s > 0:
            raise ValueError(f"body_timeout_s: must be > 0, got {idle_timeout_s}")
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        encoding = _header(scope, b"content-encoding")
        if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
            await _refuse_encoding(scope, send, encoding.decode("latin-1"))
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(scope, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    message = await receive()
            except TimeoutError:
                await self._time_out(scope, send, size)
                return
            if message["type"] != "http.request":
                return  # the client went away before its body ended
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _time_out(self, scope: Scope, send: Send, received: int) -> None:
        client = scope.get("client")
        log.info(
            "closed the connection from %s: its request body stalled after %d bytes, nothing "
            "more within %g s (--body-timeout)",
            f"{client[0]}:{client[1]}" if client else "a client",
            received,
            self.idle_timeout_s,
        )
        message = (
            f"request body stalled: no bytes of it for {self.idle_timeout_s:g} s after "
            f"{received} (--body-timeout); the connection is closed, send the request again"
        )
        await _refuse_body(scope, send, 408, message, "request_timeout")

    async def _refuse(self, scope: Scope, send: Send) -> None:
        message = f"request body exceeds {self.max_bytes} bytes (--max-request-body-bytes)"
        await _refuse_body(scope, send, 413, message, "request_too_large")


async def _refuse_encoding(scope: Scope, send: Send, encoding: str) -> None:
    message = (
        f"request bodies are not decompressed: Content-Encoding {encoding[:40]!r} is not "
        "supported; send the JSON uncompressed"
    )
    await _refuse_body(scope, send, 415, message, "unsupported_content_encoding")


async def _refuse_body(scope: Scope, send: Send, status: int, message: str, code: str) -> None:
    """The refusal of a request's body, in the API's error shape; the connection closes after it
    (the rest of the body may be unread)."""
    body = error_body(message, type_="invalid_request_error", param="body", code=code)
    response = error_response(body, status, headers={"Connection": "close"})
    await response(scope, _no_receive, send)


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return None


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body in one message, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
