"""Replicas that answer what no engine would (found by probing the router with a misbehaving
backend): an answer that is not HTTP, a header with a control character, a body that never
ends; and what the router passes on of a client's request and of a chat too long to hash."""

from __future__ import annotations

import asyncio
import json

from fake_engine import MODEL
from router_fixtures import StartEngines, StartRouter

from kvfleet_router.prefix import MAX_BLOCKS, block_hashes
from kvfleet_router.proxy import MODEL_NAME_SHOWN
from kvfleet_router.upstream import REPLICA_HEADER

COMPLETION = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()


class RawReplica:
    """A replica at the socket: /metrics as an engine serves it, every other request answered
    with `answer` (raw bytes), or, with `endless`, a chunked JSON body that never ends."""

    def __init__(self, answer: bytes = b"", endless: bool = False) -> None:
        self.answer, self.endless = answer, endless
        self.chunks_sent = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> RawReplica:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")), 0,
                )  # fmt: skip
                await reader.readexactly(length)
                if head.startswith(b"GET /metrics"):
                    text = (
                        f'kvfleet_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
                        f'kvfleet_kv_cache_usage_ratio{{model_name="{MODEL}"}} 0.0\n'
                    ).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(text), text))  # fmt: skip
                elif self.endless:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
                    while True:
                        writer.write(b"10000\r\n" + b" " * 0x10000 + b"\r\n")
                        self.chunks_sent += 1
                        await writer.drain()
                else:
                    writer.write(self.answer)
                    await writer.drain()
                    writer.close()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def test_an_answer_that_is_not_http_is_a_failed_attempt(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """It was a 500 with a traceback ("Bad status line"), every other request under
    round-robin, and the replica was never tried away from."""
    garbage = await RawReplica(b"HELLO THIS IS NOT HTTP\r\n\r\n").start()
    [good] = await start_engines(1)
    try:
        router = await start_router([garbage.url, good.url], strategy="round-robin")
        for _ in range(4):
            response = await router.post("/v1/completions", COMPLETION)
            assert response.status == 200
            assert response.headers[REPLICA_HEADER] == good.url.removeprefix("http://")
        metrics = await (await router.http.get(router.url + "/metrics")).text()
        assert 'kvfleet_router_retries_total{reason="lost"}' in metrics
    finally:
        await garbage.stop()


async def test_a_header_with_a_control_character_is_left_out(start_router: StartRouter) -> None:
    """X-Bad: a\\x01b made aiohttp refuse to write the answer: an empty reply, counted as a
    success."""
    body = b'{"id": "cmpl-1", "choices": []}'
    replica = await RawReplica(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Bad: a\x01b\r\n"
        b"X-Good: fine\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    ).start()
    try:
        router = await start_router([replica.url])
        response = await router.post("/v1/completions", COMPLETION)
        assert response.status == 200 and await response.read() == body
        assert response.headers["X-Good"] == "fine" and "X-Bad" not in response.headers
        assert response.headers["Content-Length"] == str(len(body))  # relayed, its length kept
    finally:
        await replica.stop()


async def test_an_answer_is_relayed_as_it_comes_never_held_whole(
    start_router: StartRouter,
) -> None:
    """A JSON answer was read whole before the client got a byte: one that never ends grew the
    router by 1.28 GB in 2 s."""
    replica = await RawReplica(endless=True).start()
    try:
        router = await start_router([replica.url])
        response = await router.post("/v1/completions", COMPLETION)
        assert response.status == 200
        first = await asyncio.wait_for(response.content.readexactly(1 << 20), 10)
        assert first == b" " * (1 << 20)  # the client reads while the replica still writes
        response.close()
        sent = replica.chunks_sent
        await asyncio.sleep(0.3)
        assert replica.chunks_sent - sent < 64, "the router went on reading for nobody"
    finally:
        await replica.stop()


async def test_a_clients_expect_is_answered_by_the_router_not_passed_on(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """Passed on, a replica that sends no 100 Continue held the request until the first-byte
    timeout (300 s)."""
    [engine] = await start_engines(1)
    router = await start_router([engine.url])
    response = await router.post("/v1/completions", COMPLETION, expect100=True)
    assert response.status == 200
    assert "expect" not in engine.request_headers[-1]


async def test_an_unknown_models_name_is_quoted_cut_short(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    [engine] = await start_engines(1)
    router = await start_router([engine.url])
    name = "m" * 100_000
    body = json.dumps({"model": name, "prompt": "hi"}).encode()
    response = await router.post("/v1/completions", body)
    error = (await response.json())["error"]
    assert response.status == 404 and error["code"] == "model_not_found"
    assert f"'{'m' * MODEL_NAME_SHOWN}...'" in error["message"]
    assert len(error["message"]) < MODEL_NAME_SHOWN + 200


def test_a_chat_is_hashed_only_as_far_as_its_blocks_go() -> None:
    """4 MiB of 1.4 M empty messages held the event loop 1.5 s while all of them were made
    into text, most of it past what is hashed. Here a message past that point is not even
    read (not a dict: had it been, the chat would give no hashes at all)."""
    long = [{"role": "user", "content": "x" * 1000}] * (MAX_BLOCKS * 64 // 1000 + 1)
    hashes = block_hashes({"messages": [*long, 5]}, chat=True, block_chars=64)
    assert len(hashes) == MAX_BLOCKS
    assert hashes == block_hashes({"messages": long}, chat=True, block_chars=64)
    assert block_hashes({"messages": [long[0], 5]}, chat=True, block_chars=64) == []
