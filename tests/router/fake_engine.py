"""A fake engine for the router tests: a small aiohttp server with the engine's routes.

It serves /metrics with the gauges the router reads (its `waiting` and `kv_usage` are plain
attributes a test sets), answers completions with a JSON body or an event stream, and records
what it received. `status` makes it answer every completion with that code (429, 503);
`answer_gate` holds every completion before its answer (no headers) and `stream_gate` a stream
after its first chunk, until the test sets them; `disconnected` is set when a client (the
router) drops a request it holds.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

MODEL = "tiny"


class FakeEngine:
    def __init__(self, model: str = MODEL, num_gpu_blocks: int = 1000) -> None:
        self.model = model
        self.num_gpu_blocks = num_gpu_blocks
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.status: int | None = None  # answer every completion with this status
        self.retry_after: str | None = None  # ... and this Retry-After
        self.answer_gate: asyncio.Event | None = None  # hold completions before answering
        self.stream_gate: asyncio.Event | None = None  # hold streams after the first chunk
        self.die_mid_stream = False  # drop the connection after the first chunk
        self.drop_request = False  # read a completion, then drop the connection unanswered
        self.gzip_answers = False  # non-streamed answers gzip-compressed (Content-Encoding)
        self.answer_headers: list[tuple[str, str]] = []  # added to non-streamed answers
        self.request_headers: list[dict[str, str]] = []  # each completion's, lower-cased keys
        self.disconnected = asyncio.Event()
        self.bodies: list[dict[str, Any]] = []  # completion bodies received, in order
        self.authorizations: list[str | None] = []  # their Authorization headers
        self.metrics_reads = 0
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self.server = TestServer(app, port=0)
        await self.server.start_server()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_reads += 1
        label = f'{{model_name="{self.model}"}}'
        text = (
            "# HELP kvfleet_requests_waiting Requests waiting to be scheduled.\n"
            "# TYPE kvfleet_requests_waiting gauge\n"
            f"kvfleet_requests_waiting{label} {self.waiting}\n"
            f"vllm:num_requests_waiting{label} {self.waiting}\n"
            f"kvfleet_requests_running{label} 0.0\n"
            f"kvfleet_kv_cache_usage_ratio{label} {self.kv_usage}\n"
            'vllm:cache_config_info{block_size="16",'
            f'model_name="{self.model}",num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())  # from bytes, as the engine (starlette) parses
        self.bodies.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        self.request_headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.drop_request:  # as an engine that crashes on this prompt
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if self.answer_gate is not None:  # as an engine that took the request and hangs
            try:
                await self.answer_gate.wait()
            except asyncio.CancelledError:  # the client (the router) closed the connection
                self.disconnected.set()
                raise
        if self.status is not None:
            headers = {"Retry-After": self.retry_after} if self.retry_after else {}
            error = {"error": {"message": "busy", "type": "x", "param": None, "code": None}}
            return web.json_response(error, status=self.status, headers=headers)
        if not body.get("stream"):
            answer = {"id": "cmpl-1", "model": body["model"], "choices": []}
            if self.gzip_answers:
                return web.Response(
                    body=gzip.compress(json.dumps(answer).encode()),
                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
                )
            response = web.json_response(answer)
            for key, value in self.answer_headers:
                response.headers.add(key, value)
            return response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await response.write(b'data: {"n": 1}\n\n')
            if self.die_mid_stream:
                assert request.transport is not None
                request.transport.abort()
                return response
            if self.stream_gate is not None:
                await self.stream_gate.wait()
            await response.write(b'data: {"n": 2}\n\n')
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise
        return response


def chat(model: str, *turns: str) -> bytes:
    """A chat request body: a system prompt and alternating user/assistant turns."""
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 8}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return json.dumps({"model": model, "messages": messages, "max_tokens": 4}).encode()
