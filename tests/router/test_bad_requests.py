"""Malformed and hostile requests at the router: each gets a 4xx naming the problem, in the
OpenAI error shape of the engine's own answers, before any replica sees it; never a 5xx, never
a traceback in the log."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import MODEL
from router_fixtures import StartEngines, StartRouter

from kvfleet_router.cli import main as router_main
from kvfleet_router.settings import RouterSettings

COMPLETION = json.dumps({"model": MODEL, "prompt": "Hello"}).encode()


@pytest.fixture(autouse=True)
def nothing_logged_as_an_error(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.INFO)
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


async def exchange(port: int, *parts: bytes) -> tuple[int, dict[str, Any]]:
    """Sends `parts` on one connection, a moment apart; the status and JSON body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for part in parts:
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.1)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert length is not None and b"content-type: application/json" in head.lower(), head
    body = await asyncio.wait_for(reader.readexactly(int(length.group(1))), 5)
    writer.close()
    return int(head.split(b" ", 2)[1]), json.loads(body)


def post_head(length: int, *headers: bytes) -> bytes:
    lines = [b"POST /v1/completions HTTP/1.1", b"Host: x", *headers, b"Content-Length: %d" % length]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def test_a_body_that_is_not_utf8_is_a_400_as_at_the_engine(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    response = await router.post("/v1/completions", b'{"model": "tiny", "prompt": "\xff"}')
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["message"] == "request body is not UTF-8 text (invalid byte at offset 29)"
    assert (error["type"], error["param"]) == ("invalid_request_error", "body")
    assert engine.bodies == []


@pytest.mark.parametrize(
    "body",
    [
        b"\xef\xbb\xbf" + COMPLETION,  # a UTF-8 BOM (Windows PowerShell 5.1 sends one)
        COMPLETION.decode().encode("utf-16"),
    ],
    ids=["utf-8-bom", "utf-16"],
)
async def test_bodies_the_engine_reads_are_routed_not_refused(
    body: bytes, start_engines: StartEngines, start_router: StartRouter
) -> None:
    """The engine parses JSON from bytes (a BOM, UTF-16 and UTF-32 too): the router, which
    had refused them, passes them on as received."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    response = await router.post("/v1/completions", body)
    assert response.status == 200, await response.text()
    assert len(engine.bodies) == 1


async def test_expect_100_continue_over_the_limit_gets_the_413_instead_of_continue(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """curl sends `Expect: 100-continue` for bodies over 1 KiB and waits: aiohttp answered
    "100 Continue" before the handler ran, so the body came whole before its 413."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], max_request_body_bytes=1000)
    status, body = await exchange(router.port, post_head(50_000, b"Expect: 100-continue"))
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    within = json.dumps({"model": MODEL, "prompt": "x" * 100}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(post_head(len(within), b"Expect: 100-continue"))
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
        b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    writer.write(within)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 ")
    writer.close()


@pytest.mark.parametrize(
    ("encoding", "body"),
    [("gzip", gzip.compress(COMPLETION)), ("gzip", COMPLETION), ("br", b"x")],
    ids=["gzip", "gzip-label-on-plain-json", "br"],
)
async def test_an_encoded_body_is_a_415_as_at_the_engine(
    encoding: str, body: bytes, start_engines: StartEngines, start_router: StartRouter
) -> None:
    """The engine reads no Content-Encoding; the router used to decompress gzip and send the
    plain body on still labelled gzip, and to answer a mislabelled body or br with a 500."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    response = await router.post(
        "/v1/completions", body, headers={"Content-Encoding": encoding}, compress=None
    )
    assert response.status == 415
    error = (await response.json())["error"]
    assert error["code"] == "unsupported_content_encoding"
    assert f"Content-Encoding '{encoding}' is not supported" in error["message"]
    assert engine.bodies == []


async def test_a_declared_length_over_the_limit_is_a_413_before_the_body_comes(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], max_request_body_bytes=1000)
    sent = time.monotonic()
    status, body = await exchange(router.port, post_head(50_000_000) + b'{"model": ')
    assert time.monotonic() - sent < 3  # not after 1000 bytes of a body never sent
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert "larger than 1000 bytes (--max-request-body-bytes)" in body["error"]["message"]


@pytest.mark.parametrize(
    ("request_bytes", "detail"),
    [
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"zz\r\n{}\r\n0\r\n\r\n",
            "Invalid character in chunk size: b'zz'",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
            "a request line or header is longer than 8190 bytes",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-%d: y\r\n" % i for i in range(200))
            + b"\r\n",
            "Too many headers received",
        ),
        (b"GET /health HTTP/1.1\r\n\r\n", "Missing 'Host' header in request."),
    ],
    ids=["bad-chunk-size", "100-kb-header", "200-headers", "http-1.1-without-host"],
)
async def test_a_request_aiohttp_cannot_parse_is_a_400_in_the_openai_shape(
    request_bytes: bytes, detail: str, start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    status, body = await exchange(router.port, request_bytes)
    assert status == 400
    assert body == {
        "error": {
            "message": f"malformed HTTP request: {detail}",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


async def test_a_chunked_body_that_breaks_mid_way_is_a_400(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """The head and a first chunk, then a bad chunk size once the router reads the body."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    status, body = await exchange(router.port, head + b'5\r\n{"mod\r\n', b"zz\r\nabc\r\n0\r\n\r\n")
    assert status == 400
    error = body["error"]
    assert error["message"] == "request body is malformed: Invalid character in chunk size: b'zz'"
    assert (error["type"], error["param"]) == ("invalid_request_error", "body")
    assert engine.bodies == []


async def test_an_absolute_form_target_and_http_1_0_without_host_are_served(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """RFC 9112: a server must accept the absolute form (the router routes on its path only, to
    its own replicas), and Host is required of HTTP/1.1 requests alone."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    absolute = (
        b"GET http://elsewhere.example/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert await exchange(router.port, absolute) == (200, {"status": "ok"})
    assert await exchange(router.port, b"GET /health HTTP/1.0\r\n\r\n") == (200, {"status": "ok"})
    forwarded = b"POST http://elsewhere.example/v1/completions HTTP/1.0\r\n"
    status, body = await exchange(
        router.port, forwarded + b"Content-Length: %d\r\n\r\n" % len(COMPLETION) + COMPLETION
    )
    assert (status, body["id"]) == (200, "cmpl-1")
    assert engine.bodies == [json.loads(COMPLETION)]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_that_stalls_gets_408_after_the_body_timeout_and_is_closed(
    framing: str,
    start_engines: StartEngines,
    start_router: StartRouter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], body_timeout_s=0.5)
    if framing == "chunked":
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        request = head + b"a\r\n" + COMPLETION[:10] + b"\r\n"
    else:
        request = post_head(len(COMPLETION)) + COMPLETION[:10]
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(request)
    sent = time.monotonic()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    waited = time.monotonic() - sent
    assert head.startswith(b"HTTP/1.1 408 ")
    rest = await asyncio.wait_for(reader.read(), 5)  # to the end: the router closed it
    writer.close()
    error = json.loads(rest)["error"]
    assert 0.45 <= waited <= 0.5 + 1.5
    assert (error["code"], error["param"]) == ("request_timeout", "body")
    assert "no bytes of it for 0.5 s after 10 (--body-timeout)" in error["message"]
    assert engine.bodies == []
    (line,) = [r for r in caplog.records if "(--body-timeout)" in r.getMessage()]
    assert line.levelno == logging.INFO and "from 127.0.0.1:" in line.getMessage()


async def test_a_body_trickling_in_for_longer_than_the_body_timeout_is_routed(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """The timeout bounds the wait for the next bytes, not the whole body."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], body_timeout_s=0.5)
    pieces = [COMPLETION[i : i + 8] for i in range(0, len(COMPLETION), 8)]
    assert len(pieces) * 0.25 > 0.5 * 2
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(post_head(len(COMPLETION)))
    for piece in pieces:
        await asyncio.sleep(0.25)
        writer.write(piece)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 200 ")
    assert engine.bodies == [json.loads(COMPLETION)]


def test_the_body_timeout_flag_is_read_and_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[RouterSettings] = []
    monkeypatch.setattr("kvfleet_router.app.run", seen.append)
    backend = ["--backend", "http://127.0.0.1:8001"]
    assert router_main(backend) == 0
    assert router_main([*backend, "--body-timeout", "2.5"]) == 0
    assert [s.body_timeout_s for s in seen] == [60.0, 2.5]
    with pytest.raises(SystemExit) as exit_info:
        router_main([*backend, "--body-timeout", "0"])
    assert exit_info.value.code == 2
    assert "--body-timeout: must be a positive number of seconds or inf, got 0" in (
        capsys.readouterr().err
    )
    # inf, as the engine takes it (the operator passes the engine's value on): no timeout
    assert router_main([*backend, "--body-timeout", "inf"]) == 0
    assert seen[-1].body_timeout_s == float("inf")


async def test_a_wrong_method_is_a_405_naming_the_allowed_ones_in_the_openai_shape(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """aiohttp answered `405: Method Not Allowed` as text/plain, with no Allow header."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    for method, path, allowed in (
        ("PUT", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/models", "GET, HEAD"),
        ("POST", "/health", "GET, HEAD"),
    ):
        response = await router.http.request(method, router.url + path)
        assert response.status == 405, (method, path)
        assert response.headers["Allow"] == allowed
        assert await response.json() == {
            "error": {
                "message": f"method {method} is not allowed on {path}; allowed: {allowed}",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
    assert engine.bodies == []


async def test_an_unknown_path_is_a_404_in_the_openai_shape(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], api_key="sk-1")
    response = await router.post(
        "/v1/embeddings", COMPLETION, headers={"Authorization": "Bearer sk-1"}
    )
    assert response.status == 404
    error = (await response.json())["error"]
    assert error["message"] == (
        "no route for '/v1/embeddings'; the router serves /health, /ready, /metrics, "
        "/v1/models, /v1/completions, /v1/chat/completions"
    )
    assert (error["type"], error["code"]) == ("invalid_request_error", None)
    # Without the key it is the 401 first, as at the engine: no route is disclosed.
    assert (await router.http.get(router.url + "/nope")).status == 401


async def test_head_on_the_get_routes_is_served(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    for path in ("/health", "/ready", "/metrics", "/v1/models"):
        assert (await router.http.head(router.url + path)).status == 200, path


async def test_an_integer_past_python_s_digit_limit_is_a_400_saying_so(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """The message used to be Python's own: "... use sys.set_int_max_str_digits() ..."."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 1%s}' % (MODEL.encode(), b"0" * 5000)
    response = await router.post("/v1/completions", body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["message"] == (
        "request body is not accepted: it holds an integer of more than 4300 digits"
    )
    assert error["param"] == "body"
    assert engine.bodies == []


async def test_a_key_with_a_lone_surrogate_is_a_400_saying_the_text_is_not_unicode(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """JSON's "\\ud800" escape parses to a string UTF-8 cannot hold; as a key the engine names
    no field and says "request body must be a JSON object", which it is."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    body = b'{"\\ud800": 1, "model": "%s", "prompt": "Hi"}' % MODEL.encode()
    response = await router.post("/v1/completions", body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["message"] == (
        "request body is not valid JSON text: the key '\\ud800' holds a lone UTF-16 surrogate, "
        "which is not Unicode text"
    )
    assert error["param"] == "body"
    assert engine.bodies == []


async def test_a_body_without_a_content_type_goes_on_without_one(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """The router's client filled in application/octet-stream, so the engine's 400 named that
    instead of saying the header is missing (test_router_engine_contract.py has its answer)."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    status, _ = await exchange(router.port, post_head(len(COMPLETION)) + COMPLETION)
    typed = post_head(len(COMPLETION), b"Content-Type: text/plain") + COMPLETION
    status_typed, _ = await exchange(router.port, typed)
    assert status == status_typed == 200
    assert [headers.get("content-type") for headers in engine.request_headers] == [
        None,
        "text/plain",
    ]


async def test_an_expectation_the_router_cannot_meet_is_a_417_in_the_openai_shape(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """It was aiohttp's text/plain "Unknown Expect"."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    response = await router.post("/v1/completions", COMPLETION, headers={"Expect": "teapot"})
    assert response.status == 417
    error = (await response.json())["error"]
    assert error["message"] == "unknown Expect: 'teapot'; only 100-continue"
    assert engine.bodies == []
