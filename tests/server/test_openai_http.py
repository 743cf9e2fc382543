"""The real app behind `kvfleet serve`'s HTTP protocol, as clients reach it: `curl --http2`'s
upgrade request is served, a huge head gets a 431, HEAD answers on every GET route, null means
a field's default, and a path with a trailing slash is not redirected."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from serverutil import MODEL_NAME

from kvfleet_engine.server.protocol import ChatCompletionRequest, CompletionRequest

GOOD = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection, read to the server's close (`Connection: close`)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(30)
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (x.split(":", 1) for x in lines)}
    return int(status_line.split()[1]), headers, body


def test_a_completion_sent_as_curl_http2_does_over_plain_http_is_served(live_server) -> None:  # type: ignore[no-untyped-def]
    """`curl --http2` asks to upgrade to h2c: the body was thrown away ("request body is
    empty"); now the header is ignored and the request served over HTTP/1.1."""
    body = json.dumps(GOOD).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings, close"
        b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    status, _, answer = exchange(live_server.url, request)
    assert status == 200, answer
    completion = json.loads(answer)
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] <= 2


def test_a_huge_header_gets_431_in_the_openai_error_shape(live_server) -> None:  # type: ignore[no-untyped-def]
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    status, headers, answer = exchange(live_server.url, request)
    assert status == 431 and headers["connection"] == "close"
    error = json.loads(answer)["error"]
    assert error["code"] == "request_head_too_large" and error["type"] == "invalid_request_error"


def test_an_unknown_method_gets_a_json_400(live_server) -> None:  # type: ignore[no-untyped-def]
    status, headers, answer = exchange(live_server.url, b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(answer)["error"]["message"].startswith("malformed HTTP request")


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models", "/debug/profile"])
def test_head_answers_every_get_route_without_a_body(live_server, path: str) -> None:  # type: ignore[no-untyped-def]
    get = httpx.get(f"{live_server.url}{path}", timeout=30)
    head = httpx.head(f"{live_server.url}{path}", timeout=30)
    assert head.status_code == get.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_head_on_a_post_route_is_405_naming_post(live_server) -> None:  # type: ignore[no-untyped-def]
    r = httpx.head(f"{live_server.url}/v1/completions", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_head_routes_stay_out_of_the_schema(live_server) -> None:  # type: ignore[no-untyped-def]
    paths = httpx.get(f"{live_server.url}/openapi.json", timeout=30).json()["paths"]
    assert set(paths["/health"]) == {"get"}


def optional_fields_as_null(model: type[BaseModel]) -> dict[str, None]:
    return {name: None for name, field in model.model_fields.items() if not field.is_required()}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("completions", {**optional_fields_as_null(CompletionRequest), **GOOD}),
        ("chat/completions", {**optional_fields_as_null(ChatCompletionRequest), **CHAT}),
    ],
)
def test_null_is_accepted_for_every_optional_field(
    live_server, path: str, body: dict[str, Any]
) -> None:  # type: ignore[no-untyped-def]
    """`n`, `stream`, `echo`, `ignore_eos` and chat `logprobs` refused null ("Input should be
    a valid integer/boolean") while other fields took it."""
    assert {"n", "stream", "ignore_eos", "logprobs"} <= set(body)
    r = httpx.post(f"{live_server.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert len(answer["choices"]) == 1 and answer["choices"][0].get("logprobs") is None


def test_max_tokens_null_is_the_default_16(live_server) -> None:  # type: ignore[no-untyped-def]
    """It generated to the end of the context."""
    body = {**GOOD, "max_tokens": None, "ignore_eos": True}
    r = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {**GOOD, "model": None}, "model"),
        ("chat/completions", {**CHAT, "messages": None}, "messages"),
    ],
)
def test_null_for_a_required_field_is_refused_by_name(
    live_server, path: str, body: dict[str, Any], param: str
) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(f"{live_server.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_host_header(live_server) -> None:  # type: ignore[no-untyped-def]
    """It answered 307 with a Location built from the Host header the client chose."""
    r = httpx.post(
        f"{live_server.url}/v1/completions/",
        json=GOOD,
        headers={"host": "evil.example"},
        timeout=30,
    )
    assert r.status_code == 404 and "location" not in r.headers
    error = r.json()["error"]
    assert error["message"] == "no route POST '/v1/completions/'", error
