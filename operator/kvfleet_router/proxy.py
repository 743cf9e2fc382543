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

import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvfleet_router import metrics as m
from kvfleet_router.auth import bearer
from kvfleet_router.metrics import RouterMetrics
from kvfleet_router.prefix import block_hashes
from kvfleet_router.replicas import Replica, ReplicaPool
from kvfleet_router.request_body import RequestBody, error_response
from kvfleet_router.settings import RouterSettings
from kvfleet_router.strategies import RoutedRequest, Strategy
from kvfleet_router.upstream import (
    HOP_BY_HOP,
    Declined,
    Failed,
    Upstream,
    end_to_end,
)
from kvfleet_router.waiting import QueueFull, WaitingQueue

CHAT_PATH = "/v1/chat/completions"

# An unknown model name is quoted this far (a client may send 4 MiB of it), as the engine does.
MODEL_NAME_SHOWN = 256


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
        self._body = RequestBody(settings)
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
        read = await self._body.read(request)
        if isinstance(read, web.Response):
            result.outcome = m.BAD_REQUEST
            return read
        raw, body = read
        model = body.get("model")
        if not isinstance(model, str) or not model:
            result.outcome = m.BAD_REQUEST
            return error_response(400, "model: required, the served model name (a string)", "model")
        known = self.model_names()
        if known and model not in known:
            result.outcome = m.UNKNOWN_MODEL
            served = ", ".join(repr(name) for name in sorted(known))
            shown = model if len(model) <= MODEL_NAME_SHOWN else model[:MODEL_NAME_SHOWN] + "..."
            return error_response(
                404,
                f"model {shown!r} does not exist; this router serves {served}",
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
                    return error_response(
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
                if not self._pool.is_available(replica):
                    continue  # it left, or went out, while an earlier attempt was on its way
                answer = await self._try(request, replica, url_path, raw, headers, routed, result)
                if answer is None:
                    continue  # the connection failed: the replica is out
                if isinstance(answer, Failed):
                    attempts += 1
                    failed.append(answer)
                    if answer.reason == m.TIMED_OUT:
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
        num_lost = sum(f.reason == m.LOST for f in failed)
        num_timed_out = len(failed) - num_lost
        if not num_timed_out:
            result.outcome = m.BROKEN
            return error_response(
                502,
                f"the replica closed the connection before answering ({num_lost} of "
                f"{settings.max_attempts} attempts)",
                type_="bad_gateway",
            )
        result.outcome = m.TIMEOUT
        also = f"; {num_lost} closed the connection" if num_lost else ""
        return error_response(
            504,
            f"no replica answered within {settings.upstream_first_byte_timeout_s:g} s "
            f"(--upstream-first-byte-timeout; {num_timed_out} of {settings.max_attempts} "
            f"attempts timed out{also})",
            type_="gateway_timeout",
        )

    def _no_replica(self) -> web.Response:
        settings = self._settings
        return error_response(
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
