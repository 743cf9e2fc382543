"""A request body at the router: read once, bounded and parsed, or refused with the 4xx the
engine answers the same body with (so a client sees one answer whichever it reached), in the
OpenAI error shape.

Refused by its headers alone, before any of the body is read: a Content-Encoding (415: bodies
are not decompressed, at the engine either) and a Content-Length over --max-request-body-bytes
(413, also sent instead of `100 Continue`). Refused while reading: a chunked body past the limit
(413), a body whose next bytes do not come within --body-timeout (408; the connection closes at
once), chunked framing that breaks (400). Refused once read: a body that is not UTF-8/16/32
text, not JSON, nested too deeply, holding an integer past Python's digit limit, not an object,
or with a top-level key that is not Unicode text (a lone surrogate) (400).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
from typing import Any

from aiohttp import web

from kvfleet_router.server import RouterConnection, parser_error
from kvfleet_router.settings import RouterSettings

log = logging.getLogger(__name__)


class RequestBody:
    def __init__(self, settings: RouterSettings) -> None:
        self._max_bytes = settings.max_request_body_bytes
        timeout = settings.body_timeout_s
        self._idle_timeout_s = timeout
        self._deadline_s = None if math.isinf(timeout) else timeout  # asyncio.timeout's

    def refused_by_headers(self, request: web.Request) -> web.Response | None:
        """The 415 (a Content-Encoding) or 413 (a Content-Length over the limit) its headers
        earn a request, before any of its body is read."""
        encoding = request.headers.get("Content-Encoding", "").strip()
        if encoding.lower() not in ("", "identity"):  # the engine does not decompress either
            return closing_error(
                415,
                f"request bodies are not decompressed: Content-Encoding {encoding[:40]!r} is not "
                "supported; send the JSON uncompressed",
                code="unsupported_content_encoding",
            )
        if request.content_length is not None:
            if request.content_length > self._max_bytes:
                return closing_error(413, self._too_large(), code="request_too_large")
        return None

    async def expect(self, request: web.Request) -> web.Response | None:
        """`Expect: 100-continue`: the refusal its headers earn instead of "100 Continue", so
        a client (curl, for bodies over 1 KiB) does not send a body that would be refused."""
        refusal = self.refused_by_headers(request)
        if refusal is not None:
            return refusal
        if request.headers.get("Expect", "").lower() != "100-continue":
            expectation = request.headers["Expect"][:64]
            return error_response(417, f"unknown Expect: {expectation!r}; only 100-continue")
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def _too_large(self) -> str:
        return f"request body is larger than {self._max_bytes} bytes (--max-request-body-bytes)"

    async def read(self, request: web.Request) -> tuple[bytes, dict[str, Any]] | web.Response:
        """The body as received and parsed, or the 4xx that refuses it (the engine's answer to
        the same body, so a client sees one answer whichever it reached)."""
        refusal = self.refused_by_headers(request)
        if refusal is not None:
            return refusal
        try:
            raw = await self._read_raw(request)
        except _TooLarge:  # a chunked body, once past the limit
            return closing_error(413, self._too_large(), code="request_too_large")
        except _Stalled as stalled:
            return self._stalled(request, stalled.received)
        except web.RequestPayloadError as exc:  # its chunked framing broke mid-way
            return error_response(
                400,
                f"request body is malformed: {parser_error(exc.__cause__ or exc)}",
                param="body",
            )
        try:  # from bytes, as the engine parses it: UTF-8 (a BOM too), UTF-16 or UTF-32
            body = json.loads(raw)
        except UnicodeDecodeError as exc:
            message = f"request body is not UTF-8 text (invalid byte at offset {exc.start})"
            return error_response(400, message, param="body")
        except json.JSONDecodeError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}", param="body")
        except ValueError:  # the only other one: int() past sys.get_int_max_str_digits()
            message = (
                "request body is not accepted: it holds an integer of more than "
                f"{sys.get_int_max_str_digits()} digits"
            )
            return error_response(400, message, param="body")
        except RecursionError:  # arrays or objects nested thousands deep
            return error_response(400, "request body is nested too deeply", param="body")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", param="body")
        key = next((key for key in body if not _is_unicode(key)), None)
        if key is not None:  # the engine would name no field, only "must be a JSON object"
            message = (
                f"request body is not valid JSON text: the key {key[:40]!r} holds a lone UTF-16 "
                "surrogate, which is not Unicode text"
            )
            return error_response(400, message, param="body")
        return raw, body

    async def _read_raw(self, request: web.Request) -> bytes:
        """The body, each read waiting at most --body-timeout for its next bytes."""
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout(self._deadline_s):
                    chunk = await request.content.readany()
            except TimeoutError:
                raise _Stalled(size) from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self._max_bytes:
                raise _TooLarge
            chunks.append(chunk)

    def _stalled(self, request: web.Request, received: int) -> web.Response:
        timeout = self._idle_timeout_s
        peer = "a client"
        if isinstance(request.protocol, RouterConnection):  # the router's server makes them
            request.protocol.drop_unread_body()
            peer = request.protocol.peer()
        log.info(
            "closed the connection from %s: its request body stalled after %d bytes, nothing "
            "more within %g s (--body-timeout)",
            peer,
            received,
            timeout,
        )
        message = (
            f"request body stalled: no bytes of it for {timeout:g} s after {received} "
            "(--body-timeout); the connection is closed, send the request again"
        )
        return closing_error(408, message, code="request_timeout")


def _is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON's "\\ud800"), which UTF-8 cannot
    encode."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class _TooLarge(Exception):
    """The body passed --max-request-body-bytes."""


class _Stalled(Exception):
    """No bytes of the body for --body-timeout, after `received` of them."""

    def __init__(self, received: int) -> None:
        super().__init__(received)
        self.received = received


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    *,
    type_: str = "invalid_request_error",
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error body from the router itself."""
    body: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code}
    return web.json_response({"error": body}, status=status, headers=headers)


def closing_error(status: int, message: str, code: str) -> web.Response:
    """A refusal of the body itself: the connection closes after it (its body may be unread)."""
    response = error_response(status, message, param="body", code=code)
    response.force_close()
    return response
