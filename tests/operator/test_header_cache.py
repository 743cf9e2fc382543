"""Reading the GGUF header of an hf:// file: ranged GETs that grow until the header is complete,
one read per (uri, revision), failures reported and retried later."""

from __future__ import annotations

import asyncio
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvfleet_operator import header_cache
from kvfleet_operator.gguf_header import GGUFSummary, GGUFUnavailable, parse_gguf_header
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.models import ModelSpec

URI = "hf://acme/Tiny-GGUF/tiny-Q4_1.gguf"


class Hub:
    """An httpx transport serving one file under /resolve/, honouring Range (or not)."""

    def __init__(self, data: bytes, *, ranges: bool = True, status: int = 200) -> None:
        self.data = data
        self.ranges = ranges
        self.status = status
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.status != 200:
            return httpx.Response(self.status, text="Access to model acme/Tiny-GGUF is restricted")
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", request.headers.get("range", ""))
        if not self.ranges or match is None:
            return httpx.Response(200, content=self.data)
        start, last = int(match[1]), int(match[2])
        if start >= len(self.data):
            return httpx.Response(416)
        return httpx.Response(206, content=self.data[start : last + 1])

    def ranges_asked(self) -> list[str]:
        return [r.headers["range"] for r in self.requests]


async def no_token() -> str | None:
    return None


def model(uri: str = URI, revision: str | None = None) -> ModelSpec:
    return ModelSpec(uri=uri, revision=revision)


@pytest.fixture
def small_first_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(header_cache, "FIRST_RANGE_BYTES", 4096)


async def test_ranges_grow_until_the_header_is_complete(write_gguf, small_first_range) -> None:
    data = write_gguf(vocab_tokens=1000).read_bytes()
    expected = parse_gguf_header(data)
    assert expected is not None and 16384 < expected.header_bytes < 32768 < len(data)
    hub = Hub(data)
    cache = HeaderCache("https://hub.test/", transport=httpx.MockTransport(hub))

    async def token() -> str | None:
        return "hf_secret"

    summary = await cache.summary(model(revision="refs/pr/1"), token, credentials="ns/hf-token")
    assert summary == expected
    assert hub.ranges_asked() == [
        "bytes=0-4095", "bytes=4096-8191", "bytes=8192-16383", "bytes=16384-32767"
    ]  # fmt: skip
    request = hub.requests[0]
    assert str(request.url) == (
        "https://hub.test/acme/Tiny-GGUF/resolve/refs%2Fpr%2F1/tiny-Q4_1.gguf"
    )
    assert request.headers["authorization"] == "Bearer hf_secret"


async def test_one_read_per_uri_and_revision(write_gguf) -> None:
    hub = Hub(write_gguf().read_bytes())
    cache = HeaderCache(transport=httpx.MockTransport(hub))
    tokens_read = 0

    async def token() -> str | None:
        nonlocal tokens_read
        tokens_read += 1
        return None

    first = await cache.summary(model(), token, credentials="ns/hf-token")
    assert isinstance(first, GGUFSummary) and "authorization" not in hub.requests[0].headers
    assert str(hub.requests[0].url).startswith(
        "https://huggingface.co/acme/Tiny-GGUF/resolve/main/"
    )
    results = await asyncio.gather(
        *(cache.summary(model(), token, credentials="ns/hf-token") for _ in range(5))
    )
    assert results == [first] * 5 and len(hub.requests) == 1 and tokens_read == 1
    await cache.summary(model(revision="v2"), token, credentials="ns/hf-token")
    assert len(hub.requests) == 2 and "/resolve/v2/" in str(hub.requests[1].url)


async def test_a_server_that_ignores_range_is_read_only_as_far_as_needed(write_gguf) -> None:
    data = write_gguf().read_bytes()
    hub = Hub(data, ranges=False)
    summary = await HeaderCache(transport=httpx.MockTransport(hub)).summary(
        model(), no_token, credentials=None
    )
    assert summary == parse_gguf_header(data)


async def test_gated_repository_is_reported_and_retried_later(write_gguf) -> None:
    hub = Hub(write_gguf().read_bytes(), status=401)
    now = [1000.0]
    cache = HeaderCache(transport=httpx.MockTransport(hub), clock=lambda: now[0])
    result = await cache.summary(model(), no_token, credentials=None)
    assert isinstance(result, GGUFUnavailable)
    assert "HTTP 401" in result.reason and "HF_TOKEN in model.credentialsSecret" in result.reason
    now[0] += header_cache.RETRY_SECONDS - 1
    assert (
        await cache.summary(model(), no_token, credentials=None) == result
        and len(hub.requests) == 1
    )
    hub.status = 200
    now[0] += 2
    assert isinstance(await cache.summary(model(), no_token, credentials=None), GGUFSummary)
    assert len(hub.requests) == 2


async def test_not_gguf_truncated_and_oversized_headers_are_named(
    write_gguf, small_first_range
) -> None:
    async def read(data: bytes, **kwargs: int) -> str:
        cache = HeaderCache(transport=httpx.MockTransport(Hub(data)), **kwargs)
        result = await cache.summary(model(), no_token, credentials=None)
        assert isinstance(result, GGUFUnavailable)
        return result.reason

    assert "not a GGUF file" in await read(b"<html>Not found</html>")
    data = write_gguf(vocab_tokens=2000).read_bytes()
    assert "the file ends after 10000 bytes, in its header" in await read(data[:10000])
    assert "no complete GGUF header in the first 8192 bytes" in await read(data, max_bytes=8192)


class _RangeHandler(BaseHTTPRequestHandler):
    data = b""

    def do_GET(self) -> None:
        if not self.path.startswith("/acme/Tiny-GGUF/resolve/main/"):
            self.send_error(404)
            return
        start, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
        body = self.data[start : last + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(self.data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


async def test_reads_from_a_local_http_server(write_gguf, small_first_range) -> None:
    data = write_gguf(vocab_tokens=500).read_bytes()
    handler = type("Handler", (_RangeHandler,), {"data": data})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        cache = HeaderCache(f"http://127.0.0.1:{server.server_address[1]}")
        assert await cache.summary(model(), no_token, credentials=None) == parse_gguf_header(data)
        missing = await cache.summary(model("hf://acme/Other/x.gguf"), no_token, credentials=None)
        assert isinstance(missing, GGUFUnavailable) and "HTTP 404" in missing.reason
    finally:
        server.shutdown()
        server.server_close()
