"""The router as a client sees it, in front of fake engines: bad input, streaming, disconnects,
retries, the scale-from-zero queue."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest
from aiohttp import web
from fake_engine import MODEL, FakeEngine, chat
from router_fixtures import StartEngines, StartRouter

from kvfleet_router.metrics import RETRY_REASONS
from kvfleet_router.upstream import REPLICA_HEADER

COMPLETION = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()
STREAM = json.dumps({"model": MODEL, "prompt": "Hello", "stream": True}).encode()


def address(engine: FakeEngine) -> str:
    return engine.url.removeprefix("http://")


async def test_a_completion_is_forwarded_as_sent(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    response = await router.post("/v1/completions", COMPLETION)
    assert response.status == 200
    assert (await response.json())["id"] == "cmpl-1"
    assert response.headers[REPLICA_HEADER] == address(engine)
    assert engine.bodies == [json.loads(COMPLETION)]


async def test_a_compressed_answer_reaches_the_client_readable(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """A replica behind a compressing proxy or middleware: the body is relayed as encoded, with
    its Content-Encoding, so the client decodes it (without it, gzip bytes labelled JSON)."""
    (engine,) = await start_engines(1)
    engine.gzip_answers = True
    router = await start_router([engine.url])
    response = await router.post("/v1/completions", COMPLETION)
    assert response.status == 200
    assert response.headers["Content-Encoding"] == "gzip"
    assert (await response.json())["id"] == "cmpl-1"


async def test_headers_are_relayed_end_to_end_only(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """A header the replica sends twice reaches the client twice; a header the client's
    Connection header names belongs to that connection and does not reach the replica."""
    (engine,) = await start_engines(1)
    engine.answer_headers = [("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")]
    router = await start_router([engine.url])
    response = await router.post(
        "/v1/completions",
        COMPLETION,
        headers={"Connection": "keep-alive, X-Hop", "X-Hop": "secret", "X-Tenant": "a"},
    )
    assert response.status == 200
    assert response.headers.getall("Set-Cookie") == ["a=1", "b=2"]
    (sent,) = engine.request_headers
    assert "x-hop" not in sent and sent["x-tenant"] == "a"


async def test_bad_json_is_a_400_from_the_router(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    for body, param in ((b"{not json", "body"), (b"[1, 2]", "body"), (b'{"prompt": "x"}', "model")):
        response = await router.post("/v1/completions", body)
        assert response.status == 400, body
        error = (await response.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
    assert engine.bodies == []


async def test_a_body_over_the_limit_is_a_413_naming_the_flag(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], max_request_body_bytes=1024)
    body = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()
    response = await router.post("/v1/completions", body)
    assert response.status == 413
    error = (await response.json())["error"]
    assert error["message"] == "request body is larger than 1024 bytes (--max-request-body-bytes)"
    assert engine.bodies == []
    assert (await router.post("/v1/completions", COMPLETION)).status == 200


async def test_json_nested_thousands_deep_is_a_400_not_a_500(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    body = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = await router.post("/v1/completions", body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["param"], error["message"]) == ("body", "request body is nested too deeply")
    assert engine.bodies == []


async def test_an_unknown_model_is_a_404_naming_the_served_ones(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    body = json.dumps({"model": "gpt-4", "prompt": "x"}).encode()
    response = await router.post("/v1/chat/completions", body)
    assert response.status == 404
    error = (await response.json())["error"]
    assert error["code"] == "model_not_found"
    assert "'tiny'" in error["message"]
    assert engine.bodies == []


async def test_models_are_learned_from_the_replicas_without_served_model_names(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], served_model_names=())
    models = await (await router.http.get(router.url + "/v1/models")).json()
    assert [card["id"] for card in models["data"]] == [MODEL]
    response = await router.post("/v1/completions", json.dumps({"model": "x"}).encode())
    assert response.status == 404


async def test_a_stream_passes_through_chunk_by_chunk(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    engine.stream_gate = asyncio.Event()
    router = await start_router([engine.url])
    response = await router.post("/v1/completions", STREAM)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    # The first chunk arrives while the engine still holds the second one back.
    first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 2)
    assert first == b'data: {"n": 1}\n\n'
    engine.stream_gate.set()
    rest = await asyncio.wait_for(response.content.read(), 2)
    assert rest == b'data: {"n": 2}\n\ndata: [DONE]\n\n'


async def test_a_client_disconnect_cancels_the_upstream_stream_at_once(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    engine.stream_gate = asyncio.Event()  # never set: the stream would hang forever
    router = await start_router([engine.url])
    response = await router.post("/v1/completions", STREAM)
    await response.content.readuntil(b"\n\n")
    response.close()  # the client goes away mid-stream
    await asyncio.wait_for(engine.disconnected.wait(), 1.0)
    await _until(lambda: router.router.metrics.num_in_flight == 0)
    assert router.router.pool.members[address(engine)].in_flight == 0


async def test_a_client_gone_as_the_stream_ends_is_counted_not_logged_as_an_error(
    start_engines: StartEngines,
    start_router: StartRouter,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client closes its connection after the last event, before the router writes the
    stream's end: a disconnect in the router's counters, and no traceback in its log."""
    write_eof = web.StreamResponse.write_eof

    async def client_left(self: web.StreamResponse, data: bytes = b"") -> None:
        if REPLICA_HEADER not in self.headers:  # the fake engine's own stream
            return await write_eof(self, data)
        assert self._req is not None and self._req.transport is not None
        self._req.transport.close()
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    monkeypatch.setattr(web.StreamResponse, "write_eof", client_left)
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    response = await router.post("/v1/completions", STREAM)
    with pytest.raises(aiohttp.ClientPayloadError):  # no end of stream came
        await asyncio.wait_for(response.content.read(), 2)
    await _until(lambda: router.router.metrics.num_in_flight == 0)
    text = await (await router.http.get(router.url + "/metrics")).text()
    replica = address(engine)
    assert (
        f'kvfleet_router_requests_total{{outcome="disconnected",replica="{replica}"}} 1.0' in text
    )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_503_and_429_are_retried_on_another_replica(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    for status in (503, 429):
        busy, good = await start_engines(2)
        busy.status, busy.retry_after = status, "5"
        router = await start_router([busy.url, good.url], strategy="round-robin")
        served = set()
        for _ in range(4):
            response = await router.post("/v1/completions", COMPLETION)
            assert response.status == 200, status
            served.add(response.headers[REPLICA_HEADER])
        assert served == {address(good)}
        assert busy.bodies  # it was tried
        if status == 503:  # its Retry-After keeps it out: tried once, not on every request
            assert len(busy.bodies) == 1


async def test_a_refused_connection_is_retried_and_the_replica_taken_out(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    dead, good = await start_engines(2)
    router = await start_router([dead.url, good.url], strategy="round-robin")
    await dead.stop()  # the scraper has not noticed yet: the router will try it
    for _ in range(4):
        response = await router.post("/v1/completions", COMPLETION)
        assert response.status == 200
        assert response.headers[REPLICA_HEADER] == address(good)
    assert [r.address for r in router.router.pool.available()] == [address(good)]


async def test_a_request_whose_connection_closes_unanswered_is_tried_max_attempts_times(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """The replica read the request, then dropped the connection (an engine that dies on this
    prompt): it may have run it, so retries count toward --max-attempts and the client gets a
    502 naming what happened, not a 503 after the queue timeout with every replica hammered."""
    engines = await start_engines(2)
    for engine in engines:
        engine.drop_request = True
    router = await start_router([e.url for e in engines], max_attempts=3, queue_timeout_s=30)
    started = time.monotonic()
    response = await router.post("/v1/completions", COMPLETION)
    assert response.status == 502
    error = (await response.json())["error"]
    assert "closed the connection before answering (3 of 3 attempts)" in error["message"]
    assert sum(len(e.bodies) for e in engines) == 3
    assert time.monotonic() - started < 10  # not the queue timeout
    metrics = await (await router.http.get(router.url + "/metrics")).text()
    assert 'kvfleet_router_retries_total{reason="lost"} 3.0' in metrics
    # The replicas stay in routing: closing one connection is not being unreachable.
    assert len(router.router.pool.available()) == 2


async def test_a_replica_that_leaves_and_returns_at_once_is_scraped_again(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """Kubernetes may deliver a DELETED and an ADDED event for one address together: the pool
    makes a new member object, and the scraper must follow it (the old task would keep
    scraping the dropped object, leaving the new one without samples for good)."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    pool = router.router.pool
    pool.set_members({}, reachable=True)
    pool.set_members({address(engine): "engine-0"}, reachable=True)
    member = pool.members[address(engine)]
    assert member.sample is None
    pool.connect_failed(member)  # out until a scrape reaches it
    await router.wait_available(1)
    assert member.sample is not None and member.reachable


async def test_all_replicas_busy_passes_the_429_on(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    engines = await start_engines(2)
    for engine in engines:
        engine.status = 429
    router = await start_router([e.url for e in engines])
    response = await router.post("/v1/completions", COMPLETION)
    assert response.status == 429
    assert sum(len(e.bodies) for e in engines) == 2  # each tried once


async def test_nothing_is_retried_once_the_stream_started(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    engines = await start_engines(2)
    # round-robin's first request goes to the lowest address: that one dies mid-stream.
    dying, other = sorted(engines, key=address)
    dying.die_mid_stream = True
    router = await start_router([e.url for e in engines], strategy="round-robin")
    response = await router.post("/v1/completions", STREAM)
    assert response.status == 200
    assert response.headers[REPLICA_HEADER] == address(dying)
    try:
        data = await response.content.read()
    except aiohttp.ClientPayloadError:
        data = b"truncated"
    assert b'"n": 2' not in data
    assert other.bodies == []


async def test_with_no_replica_requests_wait_then_get_a_503_with_retry_after(
    start_router: StartRouter,
) -> None:
    router = await start_router(["http://127.0.0.1:9"], wait=False, queue_timeout_s=0.5)
    started = time.monotonic()
    response = await router.post("/v1/completions", COMPLETION)
    waited = time.monotonic() - started
    assert response.status == 503
    assert int(response.headers["Retry-After"]) >= 1
    assert 0.45 <= waited < 2.0
    assert "no replica" in (await response.json())["error"]["message"]


async def test_a_full_queue_answers_503_at_once(start_router: StartRouter) -> None:
    router = await start_router(["http://127.0.0.1:9"], wait=False, queue_size=1)
    waiting = asyncio.create_task(router.post("/v1/completions", COMPLETION))
    await _until(lambda: router.router.queue.num_waiting == 1)
    started = time.monotonic()
    response = await router.post("/v1/completions", COMPLETION)
    assert response.status == 503
    assert time.monotonic() - started < 0.5
    assert "already waiting" in (await response.json())["error"]["message"]
    waiting.cancel()


async def test_a_waiting_request_is_sent_once_a_replica_appears(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], wait=False)
    pool = router.router.pool
    pool.set_members({}, reachable=False)  # zero replicas
    request = asyncio.create_task(router.post("/v1/completions", chat(MODEL, "hi")))
    await _until(lambda: router.router.queue.num_waiting == 1)
    metrics = await (await router.http.get(router.url + "/metrics")).text()
    assert "kvfleet_router_queued_requests 1.0" in metrics
    pool.set_members({address(engine): "engine-0"}, reachable=True)  # scaled up: it is ready
    response = await asyncio.wait_for(request, 2)
    assert response.status == 200
    assert len(engine.bodies) == 1
    assert router.router.queue.num_waiting == 0


async def test_health_ready_and_metrics(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    assert (await router.http.get(router.url + "/health")).status == 200
    assert (await router.http.get(router.url + "/ready")).status == 200
    await router.post("/v1/completions", COMPLETION)
    await router.post("/v1/completions", b"{")
    text = await (await router.http.get(router.url + "/metrics")).text()
    replica = address(engine)
    assert f'kvfleet_router_requests_total{{outcome="success",replica="{replica}"}} 1.0' in text
    assert 'kvfleet_router_requests_total{outcome="bad_request",replica=""} 1.0' in text
    assert 'kvfleet_router_routing_decisions_total{reason="prefix",strategy="prefix"}' in text or (
        'kvfleet_router_routing_decisions_total{reason="least-load",strategy="prefix"} 1.0' in text
    )
    for name in (
        "kvfleet_router_added_latency_seconds_bucket",
        "kvfleet_router_queued_requests",
        "kvfleet_router_requests_in_flight",
        "kvfleet_router_idle_seconds",
        'kvfleet_router_replicas{state="available"} 1.0',
        "kvfleet_router_prefix_blocks_total",
        "kvfleet_router_prefix_hit_blocks_total",
    ):
        assert name in text, name
    # Every retry reason's series from start-up (a dashboard's rate is 0, not "no data").
    for reason in RETRY_REASONS:
        assert f'kvfleet_router_retries_total{{reason="{reason}"}} 0.0' in text, reason


async def _until(check: object, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def test_a_starting_replica_503s_until_ready_and_the_request_waits_for_it(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    engine.status, engine.retry_after = 503, "0.3"  # warming up
    router = await start_router([engine.url])
    request = asyncio.create_task(router.post("/v1/completions", COMPLETION))
    await asyncio.sleep(1.0)
    assert not request.done()
    engine.status = None  # warm-up done
    response = await asyncio.wait_for(request, 2)
    assert response.status == 200
    assert 3 <= len(engine.bodies) <= 6  # retried every Retry-After, not in a busy loop


async def test_a_background_task_that_dies_fails_health_and_says_why(caplog) -> None:
    """Discovery that cannot start (no kubeconfig, no in-cluster account): the router logs why
    and /health turns 503, so the liveness probe restarts the pod; before, it waited forever,
    never ready, with nothing in its log."""
    from aiohttp.test_utils import TestServer

    from kvfleet_router.app import Router
    from kvfleet_router.settings import RouterSettings

    class BrokenDiscovery:
        synced = False

        async def run(self) -> None:
            raise RuntimeError("Invalid kube-config file. No configuration found.")

    router = Router(RouterSettings(backends=("http://127.0.0.1:9",), served_model_names=(MODEL,)))
    router.discovery = BrokenDiscovery()  # type: ignore[assignment]
    server = TestServer(router.build_app(), port=0)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(50):
                response = await http.get(f"http://127.0.0.1:{server.port}/health")
                if response.status == 503:
                    break
                await asyncio.sleep(0.02)
            assert response.status == 503
            body = await response.json()
        assert body == {
            "status": "failed",
            "reason": "discovery stopped: RuntimeError: Invalid kube-config file. No "
            "configuration found.",
        }
        assert "the router's discovery stopped" in caplog.text
    finally:
        await server.close()
