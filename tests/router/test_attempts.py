"""One attempt at one replica, as a client sees it: replicas that take a request and hang, a
Retry-After given as a date, what the prefix strategy learns from failed attempts, and how an
answer names its replica."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from datetime import UTC, datetime

import aiohttp
import pytest
from fake_engine import MODEL, FakeEngine, chat
from router_fixtures import RunningRouter, StartEngines, StartRouter

from kvfleet_router.prefix import block_hashes
from kvfleet_router.strategies.prefix import rendezvous_weight
from kvfleet_router.upstream import REPLICA_HEADER, retry_after_s

COMPLETION = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()
STREAM = json.dumps({"model": MODEL, "prompt": "Hello", "stream": True}).encode()
PROMPT = chat(MODEL, "What is the capital of France? " * 4)
PROMPT_BLOCK = block_hashes(json.loads(PROMPT), chat=True, block_chars=64)[0]


def address(engine: FakeEngine) -> str:
    return engine.url.removeprefix("http://")


async def metrics_text(router: RunningRouter) -> str:
    return await (await router.http.get(router.url + "/metrics")).text()


async def test_a_replica_that_hangs_before_answering_is_given_up_for_the_next(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    engines = await start_engines(2)
    # round-robin's first request goes to the lowest address: that one takes it and hangs.
    hanging, good = sorted(engines, key=address)
    hanging.answer_gate = asyncio.Event()  # never set
    router = await start_router(
        [e.url for e in engines], strategy="round-robin", upstream_first_byte_timeout_s=0.2
    )
    started = time.monotonic()
    response = await asyncio.wait_for(router.post("/v1/completions", COMPLETION), 5)
    assert response.status == 200
    assert response.headers[REPLICA_HEADER] == address(good)
    assert time.monotonic() - started < 2
    # The router closed that connection, so the engine aborts the request it held.
    await asyncio.wait_for(hanging.disconnected.wait(), 1)
    assert 'kvfleet_router_retries_total{reason="timeout"} 1.0' in await metrics_text(router)


async def test_replicas_that_all_hang_get_a_504_after_max_attempts(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    engines = await start_engines(4)
    for engine in engines:
        engine.answer_gate = asyncio.Event()
    router = await start_router(
        [e.url for e in engines], max_attempts=3, upstream_first_byte_timeout_s=0.2
    )
    started = time.monotonic()
    response = await asyncio.wait_for(router.post("/v1/completions", COMPLETION), 5)
    assert response.status == 504
    error = (await response.json())["error"]
    assert error["type"] == "gateway_timeout"
    assert error["message"] == (
        "no replica answered within 0.2 s (--upstream-first-byte-timeout; 3 of 3 attempts "
        "timed out)"
    )
    assert sum(len(e.bodies) for e in engines) == 3
    assert time.monotonic() - started < 2  # three timeouts, not the queue timeout
    text = await metrics_text(router)
    assert 'kvfleet_router_requests_total{outcome="timeout",replica=""} 1.0' in text


async def test_a_stream_whose_replica_falls_silent_ends_with_an_error(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    engine.stream_gate = asyncio.Event()  # never set: silent after the first chunk
    router = await start_router([engine.url], upstream_idle_timeout_s=0.2)
    response = await router.post("/v1/completions", STREAM)
    assert response.status == 200
    first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 2)
    assert first == b'data: {"n": 1}\n\n'
    with pytest.raises(aiohttp.ClientPayloadError):  # broken, not a short answer that looks whole
        await asyncio.wait_for(response.content.read(), 2)
    await asyncio.wait_for(engine.disconnected.wait(), 1)  # the upstream connection is closed
    replica = address(engine)
    text = await metrics_text(router)
    assert f'kvfleet_router_requests_total{{outcome="timeout",replica="{replica}"}} 1.0' in text


async def test_a_stream_slower_than_the_first_byte_timeout_is_not_cut_once_it_started(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """The first-byte timeout ends at the answer's headers; after them only the idle timeout
    counts (an engine sends a stream's headers at once, its tokens as they come)."""
    (engine,) = await start_engines(1)
    engine.stream_gate = asyncio.Event()
    router = await start_router([engine.url], upstream_first_byte_timeout_s=0.2)
    response = await router.post("/v1/completions", STREAM)
    await response.content.readuntil(b"\n\n")
    await asyncio.sleep(0.4)
    engine.stream_gate.set()
    rest = await asyncio.wait_for(response.content.read(), 2)
    assert rest == b'data: {"n": 2}\n\ndata: [DONE]\n\n'


def test_retry_after_is_read_as_seconds_or_as_an_http_date() -> None:
    now = datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC)
    assert retry_after_s("120", now) == 120
    assert retry_after_s("Wed, 21 Oct 2015 07:28:30 GMT", now) == 30
    assert retry_after_s("Wed, 21 Oct 2015 07:27:00 GMT", now) == 0  # already past
    assert retry_after_s("Wednesday, 21-Oct-15 07:29:00 GMT", now) == 60  # RFC 850, obsolete
    assert retry_after_s("-5", now) == 0
    for unreadable in (None, "soon", "nan", ""):
        assert retry_after_s(unreadable, now) is None


async def test_a_503_with_a_retry_after_date_cools_the_replica_that_long(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    busy, good = await start_engines(2)
    busy.status = 503
    busy.retry_after = email.utils.formatdate(time.time() + 10, usegmt=True)
    router = await start_router([busy.url, good.url], strategy="round-robin")
    for _ in range(2):  # round-robin: one of the two goes to `busy` first
        response = await router.post("/v1/completions", COMPLETION)
        assert response.headers[REPLICA_HEADER] == address(good)
    assert len(busy.bodies) == 1
    cooling = router.router.pool.members[address(busy)].cool_until - time.monotonic()
    assert 8 < cooling <= 10.5  # the date, not the 1 s default for an unreadable Retry-After


OUT_OF_RANGE_DATES = (
    "Mon, 01 Jan 99999999999 00:00:00 GMT",  # a year no datetime holds
    "Mon, 01 Jan 2025 00:00:00 +99999999999999999999",  # an offset past a C int
)


def test_a_retry_after_date_out_of_range_is_unreadable() -> None:
    """The date parser raises OverflowError, not ValueError, for numbers past a C int."""
    for value in OUT_OF_RANGE_DATES:
        assert retry_after_s(value) is None


async def test_a_503_with_an_out_of_range_retry_after_goes_to_the_next_replica(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """It was a 500 from the router: the OverflowError escaped the handler."""
    busy, good = await start_engines(2)
    busy.status = 503
    busy.retry_after = OUT_OF_RANGE_DATES[0]
    router = await start_router([busy.url, good.url], strategy="round-robin")
    for _ in range(2):  # round-robin: one of the two goes to `busy` first
        response = await router.post("/v1/completions", COMPLETION)
        assert response.status == 200
        assert response.headers[REPLICA_HEADER] == address(good)
    assert len(busy.bodies) == 1


@pytest.mark.parametrize("failure", ["429", "dropped", "timeout"])
async def test_a_replica_that_failed_a_prompt_does_not_learn_its_prefix(
    failure: str, start_engines: StartEngines, start_router: StartRouter
) -> None:
    engines = await start_engines(2)
    # While neither has the prompt, the prefix strategy tries the replica it hashes to first.
    failing = max(engines, key=lambda e: rendezvous_weight(PROMPT_BLOCK, address(e)))
    other = engines[1] if failing is engines[0] else engines[0]
    other.waiting = 1  # busier: it is not for its load that `other` gets the prompt later
    if failure == "429":
        failing.status = 429
    elif failure == "dropped":
        failing.drop_request = True
    else:
        failing.answer_gate = asyncio.Event()
    router = await start_router([failing.url, other.url], upstream_first_byte_timeout_s=0.2)
    response = await asyncio.wait_for(router.post("/v1/chat/completions", PROMPT), 5)
    assert response.status == 200
    assert response.headers[REPLICA_HEADER] == address(other)
    assert len(failing.bodies) == 1
    failing.status, failing.drop_request, failing.answer_gate = None, False, None  # healed
    # Only `other` holds the prompt now: it goes there, though `failing` is less loaded.
    response = await router.post("/v1/chat/completions", PROMPT)
    assert response.headers[REPLICA_HEADER] == address(other)
    text = await metrics_text(router)
    assert 'kvfleet_router_routing_decisions_total{reason="prefix",strategy="prefix"} 1.0' in text


async def test_an_error_answer_teaches_the_prefix_strategy_nothing(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    engine.status = 500
    router = await start_router([engine.url])
    for _ in range(2):
        assert (await router.post("/v1/chat/completions", PROMPT)).status == 500
    text = await metrics_text(router)
    assert "kvfleet_router_prefix_hit_blocks_total 0.0" in text
    assert 'kvfleet_router_routing_decisions_total{reason="prefix",strategy="prefix"}' not in text


async def test_an_answer_names_its_replica_by_pod_never_by_address(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    # What discovery hands the pool in a cluster: the pod's name for each ready address.
    router.router.pool.set_members({address(engine): "llama-7f9c5-x2k4p"}, reachable=True)
    for path, body in (("/v1/completions", COMPLETION), ("/v1/completions", STREAM)):
        response = await router.post(path, body)
        assert response.status == 200
        await response.read()
        assert response.headers[REPLICA_HEADER] == "llama-7f9c5-x2k4p"
        assert not any("127.0.0.1" in value for value in response.headers.values())
    engine.status = 429  # a declined answer passed on names it the same way
    response = await router.post("/v1/completions", COMPLETION)
    assert response.status == 429
    assert response.headers[REPLICA_HEADER] == "llama-7f9c5-x2k4p"
    text = await metrics_text(router)  # and so do the metrics
    assert (
        'kvfleet_router_requests_total{outcome="success",replica="llama-7f9c5-x2k4p"} 2.0' in text
    )
    assert 'kvfleet_router_replica_in_flight{replica="llama-7f9c5-x2k4p"} 0.0' in text
    assert "127.0.0.1" not in text


async def test_a_replica_that_hung_on_a_request_is_not_tried_again_for_it(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """A replica that took the request and sent nothing within the first-byte timeout gets no
    second try of it: the client hears a 504 after one timeout, not after --max-attempts."""
    (engine,) = await start_engines(1)
    engine.answer_gate = asyncio.Event()  # never set
    router = await start_router([engine.url], max_attempts=3, upstream_first_byte_timeout_s=0.3)
    started = time.monotonic()
    response = await asyncio.wait_for(router.post("/v1/completions", COMPLETION), 5)
    assert response.status == 504
    message = (await response.json())["error"]["message"]
    assert message.endswith("1 of 3 attempts timed out)"), message
    assert len(engine.bodies) == 1
    assert time.monotonic() - started < 0.6  # one timeout, not three
