"""What the server's HTTP protocol does with a request head, for both of uvicorn's parsers
(httptools, which `kvfleet serve` runs, and h11, uvicorn's fallback), over real sockets: an
Upgrade header is ignored and the request served whole; a head over 64 KiB gets a 431 and is
not read on; a request the parser cannot read gets a JSON 400. The app is a stub: the real one
is in test_openai_http.py."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from serverutil import free_port
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvfleet_engine.server.header_timeout import http_protocol
from kvfleet_engine.server.request_head import MAX_HEAD_BYTES

BODY = b'{"model": "m", "prompt": "Hi", "max_tokens": 2}'
# What `curl --http2` sends over plain http, with a body.
H2C_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
)
NEXT_REQUEST = b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n"


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """200 "METHOD PATH BODY"."""
    body, more_body = b"", True
    while more_body:
        message = await receive()
        body += message.get("body", b"")
        more_body = message.get("more_body", False)
    reply = f"{scope['method']} {scope['path']} ".encode() + body
    headers = [(b"content-length", b"%d" % len(reply))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": reply})


@pytest.fixture(scope="module", params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        echo_app,
        host="127.0.0.1",
        port=port,
        http=http_protocol(10.0, request.param),
        lifespan="off",
        log_config=None,  # uvicorn's records reach caplog
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(30)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    return sock


class Responses:
    """The responses on a connection, in order (each with a content-length)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def next(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, value in (x.split(":", 1) for x in lines)}
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            self._read()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def echo(self) -> tuple[int, bytes]:
        status, _, body = self.next()
        return status, body

    def error(self) -> tuple[int, dict[str, Any]]:
        """An error response, then the connection closes."""
        status, headers, body = self.next()
        assert headers["content-type"] == "application/json" and headers["connection"] == "close"
        assert self.buffer == b"" and self.sock.recv(1024) == b""
        return status, json.loads(body)["error"]

    def _read(self) -> None:
        data = self.sock.recv(65536)
        assert data, f"closed after {self.buffer!r}"
        self.buffer += data


def test_an_h2c_upgrade_is_ignored_and_the_request_served_with_its_body(
    port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """httptools skipped the body of any request asking to upgrade (the app read an empty
    one) and dropped the request after it."""
    with connect(port) as sock:
        responses = Responses(sock)
        sock.sendall(H2C_HEAD + BODY + NEXT_REQUEST)
        assert responses.echo() == (200, b"POST /v1/completions " + BODY)
        assert responses.echo() == (200, b"GET /next ")
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_upgrade_whose_body_comes_later_is_served_with_it(port: int) -> None:
    with connect(port) as sock:
        responses = Responses(sock)
        sock.sendall(H2C_HEAD)
        time.sleep(0.2)
        sock.sendall(BODY[:10])
        time.sleep(0.2)
        sock.sendall(BODY[10:])
        assert responses.echo() == (200, b"POST /v1/completions " + BODY)


def test_a_websocket_upgrade_without_a_websocket_library_is_served_as_http(port: int) -> None:
    head = b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    with connect(port) as sock:
        responses = Responses(sock)
        sock.sendall(head + NEXT_REQUEST)
        assert responses.echo() == (200, b"GET /ws ")
        assert responses.echo() == (200, b"GET /next ")


@pytest.mark.parametrize(
    "head",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 10_000 + b"\r\n",
        b"GET /" + b"a" * (MAX_HEAD_BYTES + 1) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["one-long-header", "many-headers", "long-target"],
)
def test_a_head_over_the_limit_gets_431(port: int, head: bytes) -> None:
    with connect(port) as sock:
        sock.sendall(head)
        status, error = Responses(sock).error()
    assert status == 431, error
    assert error["code"] == "request_head_too_large" and "65,536 bytes" in error["message"]


def test_a_head_within_the_limit_is_served(port: int) -> None:
    filler = b"a" * (MAX_HEAD_BYTES - 1024)
    with connect(port) as sock:
        responses = Responses(sock)
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nX-Big: " + filler + b"\r\n\r\n")
        assert responses.echo() == (200, b"GET /big ")


def test_a_head_that_goes_on_is_not_read_on(port: int) -> None:
    """A 100 MB header was read whole, and answered 200; now the server stops after the limit
    (and what one read brings), so sending the rest fails."""
    sent, chunk = 0, b"a" * (1 << 20)
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        with pytest.raises(OSError):  # reset or broken pipe: the server closed
            while sent < 64 << 20:
                sock.sendall(chunk)
                sent += len(chunk)
    assert sent < 32 << 20  # what the sockets' buffers took before the close, at most


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x00\x01\x02\xff\r\n\r\n",
    ],
    ids=["bad-chunk-size", "garbage"],
)
def test_a_request_the_parser_cannot_read_gets_a_json_400(port: int, request_bytes: bytes) -> None:
    with connect(port) as sock:
        sock.sendall(request_bytes)
        status, error = Responses(sock).error()
    assert status == 400, error
    assert error["code"] == "malformed_request"
    assert error["message"].startswith("malformed HTTP request: "), error
