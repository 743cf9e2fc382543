"""One request through the router: read and parse the body once, check it, rank the replicas,
send it to the best one, retry elsewhere while nothing has reached the client, and pass the
answer back (an event stream chunk by chunk, as it comes).

Retries: a refused or failed connection, a 503 (draining, starting: that replica cools down for
its Retry-After), a 429 (busy) or no answer headers within --upstream-first-byte-timeout
(hung; either is not tried again for this request) moves the request to the next replica of
the ranking; once the
ranking is used up it waits in the queue for another replica until its deadline, unless every
replica answered 429 (that answer goes to the client, which backs off). Only 429s, connections
closed after the request was sent and timeouts count toward `max_attempts`: a refused
connection takes the replica out until a scrape reaches it again, a 503 for its Retry-After (at
least MIN_COOL_DOWN_S), so neither can loop, and a request that meets only starting or stopping
replicas waits for a serving one, as at zero. Once the first byte went to the client nothing is
retried: a replica that dies or falls silent (--upstream-idle-timeout) mid-stream ends the
stream. A client that disconnects cancels the handler (aiohttp's handler_cancellation), which
closes the upstream connection at once, and the engine aborts the request.

The prefix strategy learns where a prompt went only from a 2xx answer: a replica that failed or
declined it does not hold its prefix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvfleet_router import metrics as m
from kvfleet_router.auth import bearer
from kvfleet_router.metrics import RouterMetrics
from kvfleet_router.prefix import block_hashes
from kvfleet_router.replicas import Replica, ReplicaPool
from kvfleet_router.server import RouterConnection, parser_error
from kvfleet_router.settings import RouterSettings
from kvfleet_router.strategies import RoutedRequest, Strategy
from kvfleet_router.upstream import (
    HOP_BY_HOP,
    LOST,
    TIMED_OUT,
    Declined,
    Failed,
    Upstream,
    end_to_end,
)
from kvfleet_router.waiting import QueueFull, WaitingQueue

CHAT_PATH = "/v1/chat/completions"

log = logging.getLogger(__name__)


class _TooLarge(Exception):
    """The body passed --max-request-body-bytes."""


class _Stalled(Exception):
    """No bytes of the body for --body-timeout, after `received` of them."""

    def __init__(self, received: int) -> None:
        super().__init__(received)
        self.received = received


@dataclass
class _Outcome:
    """How one request ended, for kvfleet_router_requests_total."""

    replica: str = ""  # host:port that answered; "" when the router answered itself
    outcome: str = m.DISCONNECTED  # until something else is known


class Proxy:
    def __init__(
        self,
        settings: RouterSettings,
        pool: ReplicaPool,
        queue: WaitingQueue,
        strategy: Strategy,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._queue = queue
        self._strategy = strategy
        self._metrics = metrics
        self._upstream = Upstream(
            session, settings.upstream_first_byte_timeout_s, settings.upstream_idle_timeout_s
        )
        self.started_at = int(time.time())
        self._served = frozenset(settings.served_model_names)

    def model_names(self) -> frozenset[str]:
        """What clients may ask for: the configured names, or those the replicas report."""
        if self._served:
            return self._served
        names: frozenset[str] = frozenset()
        for replica in self._pool.members.values():
            if replica.sample is not None:
                names |= replica.sample.model_names
        return names

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models, answered by the router (it must work at zero replicas too)."""
        cards = [
            {"id": name, "object": "model", "created": self.started_at, "owned_by": "kvfleet"}
            for name in sorted(self.model_names())
        ]
        return web.json_response({"object": "list", "data": cards})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions and /v1/chat/completions."""
        arrived = time.monotonic()
        result = _Outcome()
        self._metrics.started()
        try:
            return await self._forward(request, arrived, result)
        finally:
            self._metrics.finished(result.replica, result.outcome)

    async def _forward(
        self, request: web.Request, arrived: float, result: _Outcome
    ) -> web.StreamResponse:
        read = await self._read_body(request)
        if isinstance(read, web.Response):
            result.outcome = m.BAD_REQUEST
            return read
        raw, body = read
        model = body.get("model")
        if not isinstance(model, str) or not model:
            result.outcome = m.BAD_REQUEST
            return _error(400, "model: required, the served model name (a string)", "model")
        known = self.model_names()
        if known and model not in known:
            result.outcome = m.UNKNOWN_MODEL
            served = ", ".join(repr(name) for name in sorted(known))
            return _error(
                404,
                f"model {model!r} does not exist; this router serves {served}",
                param="model",
                code="model_not_found",
            )
        routed = RoutedRequest(
            block_hashes(body, request.path == CHAT_PATH, self._settings.block_chars)
        )
        headers = dict(end_to_end(request.headers, HOP_BY_HOP))
        if self._settings.api_key is not None:  # the client's key was checked: send ours
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = bearer(self._settings.api_key)
        return await self._send(request, raw, headers, routed, arrived, result)

    def refused_by_headers(self, request: web.Request) -> web.Response | None:
        """The 415 (a Content-Encoding) or 413 (a Content-Length over the limit) its headers
        earn a request, before any of its body is read."""
        encoding = request.headers.get("Content-Encoding", "").strip()
        if encoding.lower() not in ("", "identity"):  # the engine does not decompress either
            return _closing(
                415,
                f"request bodies are not decompressed: Content-Encoding {encoding[:40]!r} is not "
                "supported; send the JSON uncompressed",
                code="unsupported_content_encoding",
            )
        if request.content_length is not None:
            if request.content_length > self._settings.max_request_body_bytes:
                return _closing(413, self._too_large(), code="request_too_large")
        return None

    async def expect(self, request: web.Request) -> web.Response | None:
        """`Expect: 100-continue`: the refusal its headers earn instead of "100 Continue", so
        a client (curl, for bodies over 1 KiB) does not send a body that would be refused."""
        refusal = self.refused_by_headers(request)
        if refusal is not None:
            return refusal
        if request.headers.get("Expect", "").lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {request.headers['Expect']}")
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def _too_large(self) -> str:
        limit = self._settings.max_request_body_bytes
        return f"request body is larger than {limit} bytes (--max-request-body-bytes)"

    async def _read_body(self, request: web.Request) -> tuple[bytes, dict[str, Any]] | web.Response:
        """The body as received and parsed, or the 4xx that refuses it (the engine's answer to
        the same body, so a client sees one answer whichever it reached)."""
        refusal = self.refused_by_headers(request)
        if refusal is not None:
            return refusal
        try:
            raw = await self._read_raw(request)
        except _TooLarge:  # a chunked body, once past the limit
            return _closing(413, self._too_large(), code="request_too_large")
        except _Stalled as stalled:
            return self._stalled(request, stalled.received)
        except web.RequestPayloadError as exc:  # its chunked framing broke mid-way
            return _error(
                400,
                f"request body is malformed: {parser_error(exc.__cause__ or exc)}",
                param="body",
            )
        try:  # from bytes, as the engine parses it: UTF-8 (a BOM too), UTF-16 or UTF-32
            body = json.loads(raw)
        except UnicodeDecodeError as exc:
            message = f"request body is not UTF-8 text (invalid byte at offset {exc.start})"
            return _error(400, message, param="body")
        except ValueError as exc:
            return _error(400, f"request body is not valid JSON: {exc}", param="body")
        except RecursionError:  # arrays or objects nested thousands deep
            return _error(400, "request body is nested too deeply", param="body")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", param="body")
        return raw, body

    async def _read_raw(self, request: web.Request) -> bytes:
        """The body, each read waiting at most --body-timeout for its next bytes."""
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout(self._settings.body_timeout_s):
                    chunk = await request.content.readany()
            except TimeoutError:
                raise _Stalled(size) from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self._settings.max_request_body_bytes:
                raise _TooLarge
            chunks.append(chunk)

    def _stalled(self, request: web.Request, received: int) -> web.Response:
        timeout = self._settings.body_timeout_s
        if isinstance(request.protocol, RouterConnection):
            request.protocol.drop_unread_body()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        log.info(
            "closed the connection from %s: its request body stalled after %d bytes, nothing "
            "more within %g s (--body-timeout)",
            f"{peer[0]}:{peer[1]}" if peer else "a client",
            received,
            timeout,
        )
        message = (
            f"request body stalled: no bytes of it for {timeout:g} s after {received} "
            "(--body-timeout); the connection is closed, send the request again"
        )
        return _closing(408, message, code="request_timeout")

    async def _send(
        self,
        request: web.Request,
        raw: bytes,
        headers: dict[str, str],
        routed: RoutedRequest,
        arrived: float,
        result: _Outcome,
    ) -> web.StreamResponse:
        settings = self._settings
        deadline = arrived + settings.queue_timeout_s
        url_path = request.path_qs
        # Answered 429 (busy) or no answer headers in time (hung): not again for this request.
        busy: set[str] = set()
        last: web.Response | None = None  # the last 429/503 answer, passed on if nothing works
        attempts = 0
        failed: list[Failed] = []  # attempts sent that got no answer
        waited = 0.0
        decided = False
        while attempts < settings.max_attempts and time.monotonic() < deadline:
            replicas = self._queue.available(busy)
            if not replicas and last is not None and last.status == 429:
                result.outcome = m.CLIENT_ERROR  # every replica is busy: the client backs off
                return last
            if not replicas and last is None and failed:
                # The replicas left hung on this request (or closed its connection): it has
                # waited a first-byte timeout already, the client hears so now.
                return self._unanswered(failed, result)
            if not replicas:
                queue_start = time.monotonic()
                try:
                    replicas = await self._queue.wait(deadline, busy)
                except QueueFull:
                    result.outcome = m.QUEUE_FULL
                    return _error(
                        503,
                        f"{settings.queue_size} requests are already waiting for a replica",
                        type_="service_unavailable",
                        headers={"Retry-After": str(settings.retry_after_s)},
                    )
                waited += time.monotonic() - queue_start
                self._metrics.observe_queue_wait(time.monotonic() - queue_start)
            if not replicas:
                if last is not None:
                    result.outcome = m.CLIENT_ERROR if last.status < 500 else m.ENGINE_ERROR
                    return last
                result.outcome = m.QUEUE_TIMEOUT
                return self._no_replica()
            ranking = self._strategy.rank(routed, replicas)
            if not decided:
                decided = True
                self._metrics.routed(
                    ranking.reason, len(routed.block_hashes), ranking.matched_blocks
                )
                self._metrics.observe_added_latency(time.monotonic() - arrived - waited)
            for replica in ranking.replicas:
                if attempts >= settings.max_attempts:
                    break
                answer = await self._try(request, replica, url_path, raw, headers, routed, result)
                if answer is None:
                    continue  # the connection failed: the replica is out
                if isinstance(answer, Failed):
                    attempts += 1
                    failed.append(answer)
                    if answer.reason == TIMED_OUT:
                        busy.add(replica.address)
                    continue
                if not isinstance(answer, Declined):
                    return answer
                last = answer.response
                if last.status == 429:
                    attempts += 1
                    busy.add(replica.address)
                    self._metrics.retried("429")
                else:
                    self._pool.cool_down(replica, answer.retry_after_s)
                    self._metrics.retried("503")
        if last is None and failed:  # every try was sent and got no answer
            return self._unanswered(failed, result)
        if last is None:  # the deadline passed between attempts
            result.outcome = m.QUEUE_TIMEOUT
            return self._no_replica()
        result.outcome = m.CLIENT_ERROR if last.status < 500 else m.ENGINE_ERROR
        return last

    def _unanswered(self, failed: list[Failed], result: _Outcome) -> web.Response:
        """502 when every failed attempt's connection closed, else 504."""
        settings = self._settings
        num_lost = sum(f.reason == LOST for f in failed)
        num_timed_out = len(failed) - num_lost
        if not num_timed_out:
            result.outcome = m.BROKEN
            return _error(
                502,
                f"the replica closed the connection before answering ({num_lost} of "
                f"{settings.max_attempts} attempts)",
                type_="bad_gateway",
            )
        result.outcome = m.TIMEOUT
        also = f"; {num_lost} closed the connection" if num_lost else ""
        return _error(
            504,
            f"no replica answered within {settings.upstream_first_byte_timeout_s:g} s "
            f"(--upstream-first-byte-timeout; {num_timed_out} of {settings.max_attempts} "
            f"attempts timed out{also})",
            type_="gateway_timeout",
        )

    def _no_replica(self) -> web.Response:
        settings = self._settings
        return _error(
            503,
            f"no replica became available within {settings.queue_timeout_s:g} s",
            type_="service_unavailable",
            headers={"Retry-After": str(settings.retry_after_s)},
        )

    async def _try(
        self,
        request: web.Request,
        replica: Replica,
        url_path: str,
        raw: bytes,
        headers: dict[str, str],
        routed: RoutedRequest,
        result: _Outcome,
    ) -> web.StreamResponse | Declined | Failed | None:
        """Send to one replica: the response for the client (a stream already on its way),
        a declined answer (429/503: try another), a failed attempt (sent, no answer) or None
        (it never reached the replica)."""
        replica.in_flight += 1
        try:
            answer = await self._upstream.send(replica, request.method, url_path, raw, headers)
            if answer is None:  # out until a scrape reaches it; no attempt used
                self._pool.connect_failed(replica)
                self._metrics.retried("connect")
                return None
            if isinstance(answer, Failed):
                self._metrics.retried(answer.reason)
                return answer
            if isinstance(answer, Declined):
                return answer
            if 200 <= answer.status < 300:  # the replica took the prompt: its prefix is there now
                self._strategy.routed(routed, replica)
            result.replica = replica.name
            response, result.outcome = await answer.respond(request)
            return response
        finally:
            replica.in_flight -= 1


def _error(
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


def _closing(status: int, message: str, code: str) -> web.Response:
    """A refusal of the body itself: the connection closes after it (its body may be unread)."""
    response = _error(status, message, param="body", code=code)
    response.force_close()
    return response
