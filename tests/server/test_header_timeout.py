"""--header-timeout at the HTTP protocol, for both of uvicorn's parsers (httptools, which its
"auto" picks when it imports, and h11, its fallback): a request head that does not complete in
time has its connection closed; a complete head is never cut off, however slow its body or its
response; an idle kept-alive connection is the keep-alive timeout's, not this one's. The app is
a stub: `kvfleet serve` itself is in test_serve_process.py."""

from __future__ import annotations

import asyncio
import http.client
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from serverutil import free_port
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvfleet_engine.server.header_timeout import http_protocol

HEADER_TIMEOUT_S = 0.5
KEEP_ALIVE_TIMEOUT_S = 3
SLACK_S = 1.5  # a loaded CI machine's scheduling delay, on top of the timeout
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # no blank line: the head never ends
CLOSED_MESSAGE = f"no complete request head within {HEADER_TIMEOUT_S:g} s (--header-timeout)"


async def stub_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/stream: three chunks, HEADER_TIMEOUT_S apart; anything else: 200 "METHOD PATH BODY"."""
    body, more_body = b"", True
    while more_body:
        message = await receive()
        body += message.get("body", b"")
        more_body = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    if scope["path"] == "/stream":
        for k in range(3):
            await asyncio.sleep(HEADER_TIMEOUT_S)
            await send({"type": "http.response.body", "body": b"%d" % k, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    reply = f"{scope['method']} {scope['path']} ".encode() + body
    await send({"type": "http.response.body", "body": reply})


@dataclass
class StubServer:
    port: int
    server: uvicorn.Server
    protocols: list[Any]  # every connection's protocol object

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.settimeout(HEADER_TIMEOUT_S + SLACK_S + 5)
        return sock


@pytest.fixture(scope="module", params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def stub(request: pytest.FixtureRequest) -> Iterator[StubServer]:
    protocols: list[Any] = []

    class Recorded(http_protocol(HEADER_TIMEOUT_S, request.param)):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            protocols.append(self)

    port = free_port()
    config = uvicorn.Config(
        stub_app,
        host="127.0.0.1",
        port=port,
        http=Recorded,
        lifespan="off",
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        log_config=None,  # uvicorn's records reach caplog
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.02)
    yield StubServer(port, server, protocols)
    server.should_exit = True
    thread.join(30)


@pytest.fixture(autouse=True)
def no_timer_left_and_nothing_logged_as_an_error(
    stub: StubServer, caplog: pytest.LogCaptureFixture
) -> Iterator[None]:
    """After each test, once its connections closed: no deadline runs, no error was logged."""
    caplog.set_level(logging.INFO)
    yield
    deadline = time.monotonic() + KEEP_ALIVE_TIMEOUT_S + 5
    while stub.server.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stub.server.server_state.connections
    assert not [p for p in stub.protocols if p.head_deadline.running]
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.read()


def test_a_head_that_never_completes_is_closed_after_the_timeout(
    stub: StubServer, caplog: pytest.LogCaptureFixture
) -> None:
    with stub.connect() as sock:
        opened = time.monotonic()
        sock.sendall(PARTIAL_HEAD)
        assert sock.recv(1024) == b""  # closed by the server, nothing sent
        waited = time.monotonic() - opened
    assert HEADER_TIMEOUT_S * 0.9 <= waited <= HEADER_TIMEOUT_S + SLACK_S
    assert CLOSED_MESSAGE in caplog.text


def test_a_connection_that_sends_nothing_is_closed_after_the_timeout(stub: StubServer) -> None:
    with stub.connect() as sock:
        opened = time.monotonic()
        assert sock.recv(1024) == b""
        assert time.monotonic() - opened <= HEADER_TIMEOUT_S + SLACK_S


def test_other_connections_are_served_while_a_head_stalls(stub: StubServer) -> None:
    with stub.connect() as stalled:
        stalled.sendall(PARTIAL_HEAD)
        r = httpx.get(f"{stub.url}/health", timeout=10)
        assert r.status_code == 200 and r.text == "GET /health "
        assert stalled.recv(1024) == b""


def test_a_body_slower_than_the_timeout_is_not_cut_off(stub: StubServer) -> None:
    body = b'{"prompt": "slow"}'
    with stub.connect() as sock:
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        sock.sendall(head + body[:5])
        time.sleep(HEADER_TIMEOUT_S * 3)
        sock.sendall(body[5:])
        assert read_response(sock) == (200, b"POST /echo " + body)


def test_a_response_slower_than_the_timeout_is_not_cut_off(stub: StubServer) -> None:
    r = httpx.get(f"{stub.url}/stream", timeout=30)  # 3 x the header timeout
    assert r.status_code == 200 and r.content == b"012"


def test_an_idle_kept_alive_connection_waits_for_the_keep_alive_timeout(
    stub: StubServer,
) -> None:
    """Between requests the keep-alive timeout governs, not the header timeout."""
    with stub.connect() as sock:
        sock.sendall(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock) == (200, b"GET /first ")
        time.sleep(HEADER_TIMEOUT_S * 3)  # within KEEP_ALIVE_TIMEOUT_S
        sock.sendall(b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock) == (200, b"GET /second ")


def test_a_kept_alive_connection_whose_next_head_stalls_is_closed(stub: StubServer) -> None:
    with stub.connect() as sock:
        sock.sendall(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock) == (200, b"GET /first ")
        time.sleep(HEADER_TIMEOUT_S * 2)  # idle: not the header timeout's
        sent = time.monotonic()
        sock.sendall(PARTIAL_HEAD)
        assert sock.recv(1024) == b""
        waited = time.monotonic() - sent
    assert HEADER_TIMEOUT_S * 0.9 <= waited <= HEADER_TIMEOUT_S + SLACK_S


def test_a_pipelined_head_has_the_timeout_from_the_end_of_the_response_before_it(
    stub: StubServer,
) -> None:
    """A stalled head sent behind a long response: the response is sent whole, then the
    connection closes once the header timeout has passed since that response ended."""
    with stub.connect() as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n" + PARTIAL_HEAD)
        received = b""
        while not received.endswith(b"0\r\n\r\n"):  # the chunked response's end
            chunk = sock.recv(1024)
            assert chunk, f"closed mid-response after {received!r}"
            received += chunk
        ended = time.monotonic()
        assert received.startswith(b"HTTP/1.1 200 ")
        assert sock.recv(1024) == b""
        waited = time.monotonic() - ended
    assert HEADER_TIMEOUT_S * 0.8 <= waited <= HEADER_TIMEOUT_S + SLACK_S


def test_two_pipelined_streams_then_a_stalled_head_are_both_sent_whole(stub: StubServer) -> None:
    """The first stream's end must not start the stalled head's deadline while the second
    stream is still being sent (it had cut the second off on httptools)."""
    stream = b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
    with stub.connect() as sock:
        sock.sendall(stream + stream + PARTIAL_HEAD)
        received = b""
        while received.count(b"0\r\n\r\n") < 2:  # both chunked responses' ends
            chunk = sock.recv(1024)
            assert chunk, f"closed mid-response after {received!r}"
            received += chunk
        ended = time.monotonic()
        assert received.count(b"HTTP/1.1 200 ") == 2
        assert sock.recv(1024) == b""
        waited = time.monotonic() - ended
    assert HEADER_TIMEOUT_S * 0.8 <= waited <= HEADER_TIMEOUT_S + SLACK_S


def test_a_stray_line_break_after_a_response_is_timed_as_a_head(stub: StubServer) -> None:
    """httptools skips a CRLF between requests without beginning one, and uvicorn stops its
    keep-alive timer on any bytes: the connection had stayed open with no timer at all (h11
    answers it with a 400 and closes)."""
    with stub.connect() as sock:
        sock.sendall(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock) == (200, b"GET /first ")
        sent = time.monotonic()
        sock.sendall(b"\r\n")
        sock.settimeout(KEEP_ALIVE_TIMEOUT_S + SLACK_S + 5)
        answer = b""
        while chunk := sock.recv(1024):
            answer += chunk
        waited = time.monotonic() - sent
        assert answer in (b"",) or answer.startswith(b"HTTP/1.1 400 ")
    assert waited <= HEADER_TIMEOUT_S + SLACK_S


def test_a_head_sent_in_pieces_within_the_timeout_is_served(stub: StubServer) -> None:
    with stub.connect() as sock:
        for piece in (b"GET /slow", b"ly HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
            sock.sendall(piece)
            time.sleep(HEADER_TIMEOUT_S / 8)
        assert read_response(sock) == (200, b"GET /slowly ")


def test_a_client_that_leaves_mid_head_leaves_no_timer(stub: StubServer) -> None:
    with stub.connect() as sock:
        sock.sendall(PARTIAL_HEAD)
    # the autouse fixture checks that its deadline stopped when the connection was lost


def test_a_timeout_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="header_timeout_s: expected a number of seconds > 0"):
        http_protocol(0)
