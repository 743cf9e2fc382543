"""One request at one replica over HTTP: send it, wait for the answer's headers, and pass the
answer back to the client (an event stream chunk by chunk, as it comes).

Two timeouts bound a replica that takes the connection and then hangs: its answer's headers
must come within `first_byte_timeout_s` of sending (an engine sends a stream's headers when it
takes the request, a JSON answer's once the answer is complete), and then the body within
`idle_timeout_s` of them (a stream: each chunk within `idle_timeout_s` of the one before).
What an outcome means (another replica, a cool-down, what the strategy learns) is the proxy's
to decide; this module only speaks HTTP.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvfleet_router import metrics as m
from kvfleet_router.replicas import Replica

REPLICA_HEADER = "X-Kvfleet-Replica"  # which replica answered: its pod's name
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "host", "content-length",
        # The router answered the client's Expect itself (it has the body): passed on, a
        # replica that sends no 100 Continue held the request until the first-byte timeout.
        "expect",
    }
)  # fmt: skip
# Content-Encoding is passed back: the body is relayed as the replica encoded it (the upstream
# session does not decompress), so the client needs the header to read it.
_NOT_PASSED_BACK = HOP_BY_HOP | {"date", "server"}
# Failures before the request reached a replica (refused, unresolvable, connect timed out).
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# ClientResponseError: an answer that is not HTTP (a bad status line, a header past aiohttp's
# limits), which answered the client with a 500 and a traceback.
_BROKEN = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)
# A 429 / 503 answer is read whole (it may be passed on after the other replicas declined);
# an engine's is a short JSON error, and a larger one is a broken replica's.
DECLINED_MAX_BYTES = 64 << 10
# The client's Content-Type or none: the engine's answer to a body without one must say so,
# not name the application/octet-stream aiohttp would fill in.
_NOT_ADDED = ("Content-Type",)


@dataclass(frozen=True)
class Declined:
    """A replica's 429 (busy) or 503 (starting, draining) answer, read in full: try another,
    or pass it on at the end."""

    response: web.Response

    @property
    def retry_after_s(self) -> float | None:
        return retry_after_s(self.response.headers.get("Retry-After"))


@dataclass(frozen=True)
class Failed:
    """The request was sent and no answer came: the replica may have run it (and may fail on it
    again), so another try counts toward --max-attempts."""

    reason: str  # m.LOST: the connection closed; m.TIMED_OUT: no headers (or body) in time


class Answer:
    """A replica's answer whose headers have come, its body still arriving: relayed as it
    comes, an event stream or a JSON answer alike, so the router holds no whole answer (a
    never-ending body was read into memory at 400 MB/s)."""

    def __init__(
        self, upstream: aiohttp.ClientResponse, headers: CIMultiDict[str], idle_timeout_s: float
    ) -> None:
        self.status = upstream.status
        self._upstream = upstream
        self._headers = headers
        self._idle_timeout_s = idle_timeout_s

    async def respond(self, request: web.Request) -> tuple[web.StreamResponse, str]:
        """Pass the answer on: the response, and how it ended (an outcome of
        kvfleet_router_requests_total). A replica that goes away or falls silent mid-stream
        breaks the client's stream: it sees an error, not a short answer."""
        upstream = self._upstream
        try:
            stream = web.StreamResponse(status=self.status, headers=self._headers)
            if upstream.content_length is not None and "Content-Encoding" not in self._headers:
                stream.content_length = upstream.content_length  # relayed byte for byte
            await stream.prepare(request)
            last = b"\n\n"  # the end of the last chunk relayed
            try:
                while chunk := await _next_chunk(upstream, self._idle_timeout_s):
                    await stream.write(chunk)
                    last = chunk[-2:]
                await stream.write_eof()  # fails too if the client left just as the stream ended
            except (*_BROKEN, TimeoutError) as exc:
                upstream.close()
                timed_out = isinstance(exc, TimeoutError)
                if not await self._break(request, stream, timed_out, last == b"\n\n"):
                    return stream, m.DISCONNECTED  # the write to the client failed
                return stream, m.TIMEOUT if timed_out else m.BROKEN
            return stream, outcome(self.status)
        except BaseException:
            upstream.close()  # the client went away: drop the upstream connection now
            raise
        finally:
            upstream.release()

    async def _break(
        self, request: web.Request, stream: web.StreamResponse, timed_out: bool, at_event: bool
    ) -> bool:
        """End the client's answer broken (False: the client had left): its connection closes
        before the body's end, so no client takes it for a whole answer. An event stream gets
        an error event first, as the engine ends a stream it gives up on, so an OpenAI client
        raises the reason instead of a bare connection error."""
        transport = request.transport
        if transport is None or transport.is_closing():
            return False
        headers = self._headers
        event_stream = headers.get("Content-Type", "").startswith("text/event-stream")
        if event_stream and "Content-Encoding" not in headers:
            replica = headers[REPLICA_HEADER]
            if timed_out:
                type_ = "gateway_timeout"
                message = (
                    f"replica {replica} sent nothing for {self._idle_timeout_s:g} s "
                    "(--upstream-idle-timeout); the answer is cut"
                )
            else:
                type_ = "bad_gateway"
                message = f"replica {replica} closed the stream before its end; the answer is cut"
            error = {"message": message, "type": type_, "param": None, "code": None}
            event = json.dumps({"error": error}).encode()
            try:
                cut = b"" if at_event else b"\n\n"  # ends the event the replica left half-sent
                await stream.write(cut + b"data: " + event + b"\n\n")
            except (ConnectionError, RuntimeError):
                return False
            transport.close()  # after the event is sent, unlike abort()
        else:
            transport.abort()
        return True


class Upstream:
    """The router's HTTP client to the replicas."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        first_byte_timeout_s: float,
        idle_timeout_s: float,
    ) -> None:
        self._session = session
        self._first_byte_timeout_s = first_byte_timeout_s
        self._idle_timeout_s = idle_timeout_s

    async def send(
        self, replica: Replica, method: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> Answer | Declined | Failed | None:
        """Send one request to `replica`: its answer, a declined answer (429/503), a failed
        attempt, or None (it never reached the replica)."""
        upstream: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self._first_byte_timeout_s):
                upstream = await self._session.request(
                    method,
                    replica.url + path,
                    data=body,
                    headers=headers,
                    skip_auto_headers=_NOT_ADDED,
                )
            declined = upstream.status in (429, 503)
            data = b""
            if declined:
                async with asyncio.timeout(self._idle_timeout_s):
                    data = await _read_at_most(upstream, DECLINED_MAX_BYTES)
        except _NOT_SENT:
            return None
        except (*_BROKEN, TimeoutError) as exc:
            if upstream is not None:
                upstream.close()  # the engine sees the disconnect and aborts the request
            return Failed(m.TIMED_OUT if isinstance(exc, TimeoutError) else m.LOST)
        except BaseException:
            if upstream is not None:
                upstream.close()
            raise
        # A multidict: a header the replica sent twice (Set-Cookie, Vary) goes back twice.
        answer_headers = CIMultiDict(end_to_end(upstream.headers, _NOT_PASSED_BACK))
        answer_headers[REPLICA_HEADER] = replica.name
        if declined:
            upstream.release()
            return Declined(web.Response(status=upstream.status, body=data, headers=answer_headers))
        return Answer(upstream, answer_headers, self._idle_timeout_s)


async def _read_at_most(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, if it is at most `limit` bytes (ClientPayloadError past that)."""
    data = bytearray()
    while chunk := await upstream.content.read(limit + 1 - len(data)):
        data += chunk
        if len(data) > limit:
            raise aiohttp.ClientPayloadError(f"a {upstream.status} answer of over {limit} bytes")
    return bytes(data)


async def _next_chunk(upstream: aiohttp.ClientResponse, timeout_s: float) -> bytes:
    """The next bytes of a stream as they come (b"" at its end); TimeoutError when none come
    within `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        return await upstream.content.readany()


def outcome(status: int) -> str:
    """The outcome of an answer the client got from a replica."""
    if status < 400:
        return m.SUCCESS
    return m.CLIENT_ERROR if status < 500 else m.ENGINE_ERROR


def retry_after_s(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds a Retry-After header asks for: delta-seconds or an HTTP-date (RFC 9110 section
    10.2.3; one in the past asks for 0). None when absent or unreadable."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: numbers past a C int
            return None
        if when.tzinfo is None:  # "-0000": UTC, as HTTP-dates are
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def end_to_end(headers: Mapping[str, str], dropped: frozenset[str]) -> Iterator[tuple[str, str]]:
    """The headers that go on to the other side: not `dropped`, and not those the sender's
    Connection header names (hop-by-hop for this connection only, RFC 9110 section 7.6.1)."""
    named = {token.strip().lower() for token in headers.get("Connection", "").split(",")}
    for key, value in headers.items():
        if key.lower() not in dropped and key.lower() not in named and _printable(key + value):
            yield key, value


def _printable(text: str) -> bool:
    """No control character but tab: a replica's header with one (b"a\x01b") made aiohttp
    refuse to write the client's answer, an empty reply counted as a success."""
    return not any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in text)
