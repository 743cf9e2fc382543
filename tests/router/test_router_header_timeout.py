"""--header-timeout at the router's client connections: a request head that does not complete in
time has its connection closed while other connections are served; a complete head is never cut
off, however slow its body or long its response; an idle kept-alive connection is the keep-alive
timeout's. Each test that shows what is not closed also holds a stalled head open beside it and
sees that one closed, so it cannot pass with no deadline at all."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from fake_engine import MODEL
from router_fixtures import RunningRouter, StartEngines, StartRouter

from kvfleet_router.cli import main as router_main
from kvfleet_router.server import RouterConnection
from kvfleet_router.settings import RouterSettings

HEADER_TIMEOUT_S = 0.5
SLACK_S = 1.5  # a loaded CI machine's scheduling delay, on top of the timeout
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # no blank line: the head never ends
CLOSED_MESSAGE = f"no complete request head within {HEADER_TIMEOUT_S:g} s (--header-timeout)"
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture(autouse=True)
def nothing_logged_as_an_error(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.INFO)
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]


@pytest.fixture
async def router(start_engines: StartEngines, start_router: StartRouter) -> RunningRouter:
    (engine,) = await start_engines(1)
    return await start_router([engine.url], header_timeout_s=HEADER_TIMEOUT_S)


@pytest.fixture
async def stalled(router: RunningRouter) -> AsyncIterator[Connection]:
    """A connection whose head stalls, opened at the test's start: the deadline must close it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(PARTIAL_HEAD)
    yield reader, writer
    writer.close()


async def closed_after(reader: asyncio.StreamReader, since: float) -> float:
    """Seconds from `since` until the server closed the connection, having sent nothing."""
    assert await asyncio.wait_for(reader.read(), HEADER_TIMEOUT_S + SLACK_S + 5) == b""
    return time.monotonic() - since


async def connect(router: RunningRouter) -> Connection:
    return await asyncio.open_connection("127.0.0.1", router.port)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response with a Content-Length body (the router's JSON answers)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert length is not None, head
    return int(head.split(b" ", 2)[1]), await reader.readexactly(int(length.group(1)))


async def test_a_head_that_never_completes_is_closed_while_others_are_served(
    router: RunningRouter, caplog: pytest.LogCaptureFixture
) -> None:
    opened = time.monotonic()
    reader, writer = await connect(router)
    writer.write(PARTIAL_HEAD)
    health = await router.http.get(router.url + "/health")
    assert health.status == 200 and await health.json() == {"status": "ok"}
    waited = await closed_after(reader, opened)
    assert HEADER_TIMEOUT_S * 0.9 <= waited <= HEADER_TIMEOUT_S + SLACK_S
    writer.close()
    (line,) = [r for r in caplog.records if CLOSED_MESSAGE in r.getMessage()]
    assert line.levelno == logging.INFO and line.exc_info is None
    assert "closed the connection from 127.0.0.1:" in line.getMessage()


async def test_a_connection_that_sends_nothing_is_closed(router: RunningRouter) -> None:
    opened = time.monotonic()
    reader, writer = await connect(router)
    assert await closed_after(reader, opened) <= HEADER_TIMEOUT_S + SLACK_S
    writer.close()


async def test_a_body_slower_than_the_timeout_is_not_cut_off(
    router: RunningRouter, stalled: Connection
) -> None:
    opened = time.monotonic()
    body = json.dumps({"model": MODEL, "prompt": "slow"}).encode()
    reader, writer = await connect(router)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    writer.write(body[:5])
    await asyncio.sleep(HEADER_TIMEOUT_S * 3)
    writer.write(body[5:])
    status, answer = await read_response(reader)
    assert (status, json.loads(answer)["id"]) == (200, "cmpl-1")
    writer.close()
    assert await closed_after(stalled[0], opened) <= HEADER_TIMEOUT_S + SLACK_S


async def test_an_idle_kept_alive_connection_is_not_closed_by_it(
    router: RunningRouter, stalled: Connection
) -> None:
    opened = time.monotonic()
    reader, writer = await connect(router)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await read_response(reader) == (200, b'{"status": "ok"}')
    await asyncio.sleep(HEADER_TIMEOUT_S * 3)  # idle: aiohttp's keep-alive timeout's
    writer.write(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await read_response(reader) == (200, b'{"status": "ready"}')
    writer.close()
    assert await closed_after(stalled[0], opened) <= HEADER_TIMEOUT_S + SLACK_S


async def test_a_kept_alive_connection_whose_next_head_stalls_is_closed(
    router: RunningRouter,
) -> None:
    reader, writer = await connect(router)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    await asyncio.sleep(HEADER_TIMEOUT_S * 2)  # idle: not the header timeout's
    sent = time.monotonic()
    writer.write(PARTIAL_HEAD)
    waited = await closed_after(reader, sent)
    assert HEADER_TIMEOUT_S * 0.9 <= waited <= HEADER_TIMEOUT_S + SLACK_S
    writer.close()


async def test_a_stream_longer_than_the_timeout_arrives_whole(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """A stalled head sent on the stream's connection while the stream runs: the stream is sent
    whole, then the connection closes once the header timeout has passed since it ended."""
    (engine,) = await start_engines(1)
    engine.stream_gate = asyncio.Event()  # the stream pauses after its first chunk
    router = await start_router([engine.url], header_timeout_s=HEADER_TIMEOUT_S)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "stream": True}).encode()
    reader, writer = await connect(router)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    writer.write(body)
    received = await asyncio.wait_for(reader.readuntil(b'data: {"n": 1}\n\n'), 10)
    writer.write(PARTIAL_HEAD)  # pipelined behind the stream, in a read of its own
    await asyncio.sleep(HEADER_TIMEOUT_S * 3)
    engine.stream_gate.set()
    received += await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)  # chunked end
    ended = time.monotonic()
    assert received.startswith(b"HTTP/1.1 200 ")
    assert b'data: {"n": 2}\n\n' in received and b"data: [DONE]\n\n" in received
    waited = await closed_after(reader, ended)
    assert HEADER_TIMEOUT_S * 0.8 <= waited <= HEADER_TIMEOUT_S + SLACK_S
    writer.close()


async def test_a_client_that_leaves_mid_head_leaves_no_timer(router: RunningRouter) -> None:
    _, writer = await connect(router)
    writer.write(PARTIAL_HEAD)
    await writer.drain()
    server = router.runner.server
    assert server is not None
    deadline = time.monotonic() + 5
    while not server.connections:
        assert time.monotonic() < deadline, "the connection never reached the server"
        await asyncio.sleep(0.01)
    (connection,) = server.connections
    assert isinstance(connection, RouterConnection) and connection.awaiting_head
    writer.close()
    await writer.wait_closed()
    while connection.transport is not None:
        assert time.monotonic() < deadline, "the server never saw the connection close"
        await asyncio.sleep(0.01)
    assert not connection.awaiting_head


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_the_flag_refuses_what_is_not_a_positive_number_of_seconds(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        router_main(["--backend", "http://127.0.0.1:8001", f"--header-timeout={value}"])
    assert exit_info.value.code == 2
    assert "--header-timeout: must be a positive number of seconds, got " in (
        capsys.readouterr().err
    )


def test_the_flag_is_read_into_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[RouterSettings] = []
    monkeypatch.setattr("kvfleet_router.app.run", seen.append)
    backend = ["--backend", "http://127.0.0.1:8001"]
    assert router_main(backend) == 0
    assert router_main([*backend, "--header-timeout", "2.5"]) == 0
    assert [s.header_timeout_s for s in seen] == [10.0, 2.5]


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """aiohttp's own default held idle connections for an hour; `--keep-alive-timeout` (75 s,
    above the proxies' 60 s) is what closes them, after a response as before any request."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], keep_alive_timeout_s=1.0)
    reader, writer = await connect(router)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _ = await read_response(reader)
    assert status == 200
    answered = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 1.0 + SLACK_S + 5) == b""
    assert 0.9 <= time.monotonic() - answered <= 1.0 + SLACK_S
    writer.close()


def test_the_keep_alive_timeout_flag_refuses_what_is_not_a_duration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for value in ("0", "-1", "inf"):
        with pytest.raises(SystemExit) as exit_info:
            router_main(["--backend", "http://127.0.0.1:1", "--keep-alive-timeout", value])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--keep-alive-timeout" in err and "Traceback" not in err
