"""The engine requests behind one HTTP request, and how their outputs reach the client: merged,
collected, or streamed as server-sent events that abort the requests however the response ends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvfleet_engine.client.request_stream import EngineDeadError, RequestAbortedError
from kvfleet_engine.core.profile import PhaseProfile
from kvfleet_engine.server.errors import APIError, error_body
from kvfleet_engine.server.protocol import ChatCompletionChunk, CompletionResponse, UsageInfo

if TYPE_CHECKING:
    from kvfleet_engine.client.request_stream import RequestStream
    from kvfleet_engine.outputs import CompletionOutput, RequestOutput


@dataclass
class Choice:
    """Streaming progress of one choice."""

    prompt_index: int
    num_chars_sent: int = 0
    num_tokens_sent: int = 0
    text_offset: int = 0
    finished: bool = False
    output: CompletionOutput | None = None


@dataclass
class RequestGroup:
    """The engine requests behind one HTTP request: `len(prompt_token_ids) * n` of them."""

    request_id: str
    created: int
    model: str
    prompt_token_ids: list[list[int]]
    n: int
    streams: list[RequestStream] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)  # their progress, once they run

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    def usage(self, choices: Sequence[Choice]) -> UsageInfo:
        prompt = sum(len(ids) for ids in self.prompt_token_ids)
        completion = sum(len(c.output.token_ids) for c in choices if c.output is not None)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


def advance(c: Choice, out: CompletionOutput) -> tuple[str, int]:
    """New text and the number of new tokens since the choice last sent; records the output."""
    delta = out.text[c.num_chars_sent :]
    new_tokens = len(out.token_ids) - c.num_tokens_sent
    c.num_chars_sent = len(out.text)
    c.num_tokens_sent = len(out.token_ids)
    c.finished = out.finish_reason is not None
    c.output = out
    return delta, new_tokens


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, CompletionOutput]]:
    """(choice index, completion output) from every stream, as each arrives."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out.outputs[0]
        return
    merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(k: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((k, out))
        except BaseException as exc:
            merged.put_nowait(exc)
            raise
        finally:
            merged.put_nowait(None)

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item[0], item[1].outputs[0]
    finally:
        for task in tasks:
            task.cancel()


async def collect(group: RequestGroup, http: Request) -> list[Choice]:
    """Run every engine request to completion; abort them all if the client disconnects."""
    choices = group.choices = [Choice(k // group.n) for k in range(len(group.streams))]

    async def run() -> None:
        async for k, out in merge(group.streams):
            advance(choices[k], out)

    work = asyncio.create_task(run())
    watch = asyncio.create_task(_wait_for_disconnect(http))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            raise APIError(499, "client disconnected", type_="client_closed_request")
        try:
            work.result()
        except (RequestAbortedError, EngineDeadError) as exc:
            raise APIError(503, str(exc), type_="service_unavailable") from exc
    finally:
        watch.cancel()
        group.close()
    return choices


async def _wait_for_disconnect(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def chunk_writer(
    group: RequestGroup, object_name: str, profile: PhaseProfile
) -> Callable[[dict[str, Any]], str]:
    """Formats one streamed chunk with one choice. Plain dicts and a pre-serialized envelope:
    this runs for every request at every step, on the API process's event loop."""
    envelope = json.dumps(
        {
            "id": group.request_id,
            "object": object_name,
            "created": group.created,
            "model": group.model,
        },
        separators=(",", ":"),
    )
    head = f'data: {envelope[:-1]},"choices":['
    clock = time.perf_counter

    def event(choice: dict[str, Any]) -> str:
        began = clock()
        line = f"{head}{json.dumps(choice, separators=(',', ':'))}]}}\n\n"
        profile.add("chunks", clock() - began)
        return line

    return event


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def stream_end(
    group: RequestGroup,
    choices: Sequence[Choice],
    include_usage: bool,
    usage_chunk: type[CompletionResponse | ChatCompletionChunk],
) -> Iterator[str]:
    """What closes a stream: the usage chunk, when the client asked for it, then [DONE]."""
    if include_usage:
        usage = usage_chunk(
            id=group.request_id,
            created=group.created,
            model=group.model,
            choices=[],
            usage=group.usage(choices),
        )
        yield sse(usage.model_dump())
    yield "data: [DONE]\n\n"


async def ending_in_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass events through; if the engine gives up on the request, say so in the stream."""
    try:
        async for event in events:
            yield event
    except (RequestAbortedError, EngineDeadError) as exc:
        yield sse(error_body(str(exc), type_="service_unavailable"))
        yield "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events that abort the engine requests however the response ends; the time
    spent handing chunks to the transport counts as the profile's "write"."""

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None],
        profile: PhaseProfile,
        on_chunk_written: Callable[[], bool],
    ) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self._on_close = on_close
        self._profile = profile
        self._on_chunk_written = on_chunk_written

    async def stream_response(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        clock, profile = time.perf_counter, self._profile
        stamped = False
        async for chunk in self.body_iterator:
            body = chunk.encode() if isinstance(chunk, str) else chunk
            began = clock()
            await send({"type": "http.response.body", "body": body, "more_body": True})
            profile.add("write", clock() - began)
            if not stamped:
                stamped = self._on_chunk_written()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
