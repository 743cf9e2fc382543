"""OpenAI semantics over the engine: requests -> engine requests, outputs -> responses/chunks.

One HTTP request fans out into `len(prompts) * n` engine requests with ids `{id}-{k}`; choice k
belongs to prompt k // n. Text deltas come from the engine's cumulative (incrementally
detokenized) text, so a stream sends each character once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvfleet_engine.async_engine import EngineDeadError, RequestAbortedError
from kvfleet_engine.core.profile import FIRST_TOKEN_HOPS, PhaseProfile
from kvfleet_engine.server.errors import APIError, error_body, invalid_field
from kvfleet_engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    TopLogprob,
    UsageInfo,
    unsupported_fields,
)

if TYPE_CHECKING:
    from kvfleet_engine.async_engine import AsyncEngine, RequestStream
    from kvfleet_engine.outputs import CompletionOutput, RequestOutput
    from kvfleet_engine.sampling import SamplingParams
    from kvfleet_engine.server.state import ServerState

log = logging.getLogger(__name__)

# The ASGI scope key under which the app stamps when a request's call began (time.time()).
RECEIVED_KEY = "kvfleet.received"


@dataclass
class _Choice:
    """Streaming progress of one choice."""

    prompt_index: int
    num_chars_sent: int = 0
    num_tokens_sent: int = 0
    text_offset: int = 0
    finished: bool = False
    output: CompletionOutput | None = None


@dataclass
class _Fanout:
    """The engine requests behind one HTTP request."""

    request_id: str
    created: int
    model: str
    prompt_token_ids: list[list[int]]
    n: int
    streams: list[RequestStream] = field(default_factory=list)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    def usage(self, choices: Sequence[_Choice]) -> UsageInfo:
        prompt = sum(len(ids) for ids in self.prompt_token_ids)
        completion = sum(len(c.output.token_ids) for c in choices if c.output is not None)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, state: ServerState) -> None:
        self.engine = engine
        self.state = state
        self.tokenizer = engine.tokenizer

    # --- entry points ------------------------------------------------------------------------

    async def completions(
        self, body: CompletionRequest, http: Request, priority: int | None = None
    ) -> Any:
        stamps = self._first_stamps(http)
        self._check_common(body)
        prompts = self._tokenize_prompts(body.prompt)
        fan = await self._submit(
            body, prompts, body.max_tokens, body.logprobs, priority, "cmpl", stamps
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _ending_in_error_event(self._stream_completion(fan, include_usage))
            return self._sse(events, fan)
        choices = await _collect(fan, http)
        return CompletionResponse(
            id=fan.request_id,
            created=fan.created,
            model=fan.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=c.output.text if c.output else "",
                    logprobs=self._completion_logprobs(c, body.logprobs),
                    finish_reason=c.output.finish_reason if c.output else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=fan.usage(choices),
        )

    async def chat(
        self, body: ChatCompletionRequest, http: Request, priority: int | None = None
    ) -> Any:
        stamps = self._first_stamps(http)
        self._check_common(body)
        prompt_ids = self._apply_chat_template(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        fan = await self._submit(
            body, [prompt_ids], max_tokens, num_logprobs, priority, "chatcmpl", stamps
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _ending_in_error_event(self._stream_chat(fan, include_usage, num_logprobs))
            return self._sse(events, fan)
        choices = await _collect(fan, http)
        return ChatCompletionResponse(
            id=fan.request_id,
            created=fan.created,
            model=fan.model,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=c.output.text if c.output else ""),
                    logprobs=self._chat_logprobs(c, num_logprobs),
                    finish_reason=c.output.finish_reason if c.output else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=fan.usage(choices),
        )

    # --- request side ------------------------------------------------------------------------

    def _first_stamps(self, http: Request) -> dict[str, float]:
        """The first-token stamps of a request whose handler runs now; "parse" is the time
        since the ASGI call began (`app.stamp_received`)."""
        handled = time.time()
        received = http.scope.get(RECEIVED_KEY, handled)
        self.engine.profile.add("parse", handled - received)
        return {"received": received, "handled": handled}

    def _check_common(self, body: SamplingFields) -> None:
        self.state.check_accepting()
        if body.model != self.state.settings.served_model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server serves "
                f"{self.state.settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        for name, reason in unsupported_fields(body):
            raise invalid_field(name, reason)

    def _tokenize_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._encode(prompt, add_special_tokens=True)]
        if not prompt:
            raise invalid_field("prompt", "must not be empty")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], list):
            return [list(p) for p in prompt]
        return [self._encode(p, add_special_tokens=True) for p in prompt]

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def _apply_chat_template(self, body: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid_field("messages", "this model has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja raises on conversations the template forbids
            raise invalid_field("messages", f"rejected by the chat template: {exc}") from exc
        return self._encode(str(text), add_special_tokens=False)

    def _sampling_params(
        self, body: SamplingFields, max_tokens: int, logprobs: int | None, choice: int
    ) -> SamplingParams:
        from kvfleet_engine.sampling import SamplingParams

        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        given: dict[str, Any] = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        # n > 1 with a seed: each choice gets its own seed, so the choices differ but the
        # response as a whole is reproducible.
        seed = None if body.seed is None else body.seed + choice
        try:
            return SamplingParams(
                n=1,
                seed=seed,
                max_tokens=max_tokens,
                stop=stop,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=body.skip_special_tokens,
                **kwargs,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param=_field_in(str(exc), kwargs)) from exc

    def _max_tokens(self, body: SamplingFields, max_tokens: int | None, prompt_len: int) -> int:
        max_model_len = self.state.settings.max_model_len
        if prompt_len == 0:
            raise invalid_field("prompt", "must contain at least one token")
        if prompt_len >= max_model_len:
            field_name = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise invalid_field(
                field_name,
                f"is {prompt_len} tokens; this model's context is {max_model_len} tokens, "
                "and the prompt must leave room for at least one generated token",
            )
        room = max_model_len - prompt_len
        if max_tokens is None:
            return room
        if max_tokens > room:
            chat_limit = isinstance(body, ChatCompletionRequest) and body.max_completion_tokens
            raise invalid_field(
                "max_completion_tokens" if chat_limit else "max_tokens",
                f"{max_tokens} plus the {prompt_len}-token prompt exceeds this model's context "
                f"of {max_model_len} tokens; at most {room} allowed",
            )
        return max_tokens

    async def _submit(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        header_priority: int | None,
        prefix: str,
        stamps: dict[str, float],
    ) -> _Fanout:
        for ids in prompts:
            if any(t >= self.state.settings.vocab_size for t in ids):
                raise invalid_field(
                    "prompt", f"token ids must be < {self.state.settings.vocab_size}"
                )
        limits = [self._max_tokens(body, max_tokens, len(ids)) for ids in prompts]
        params = [
            self._sampling_params(body, limits[k // body.n], logprobs, k % body.n)
            for k in range(len(prompts) * body.n)
        ]
        # The body's field wins over the X-Priority header (a gateway may set the header).
        priority = body.priority if body.priority is not None else (header_priority or 0)
        self.state.admit(sum(len(ids) for ids in prompts) * body.n, len(params))
        arrival = time.time()
        fan = _Fanout(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(arrival),
            model=body.model,
            prompt_token_ids=prompts,
            n=body.n,
        )
        try:
            for k, p in enumerate(params):
                fan.streams.append(
                    await self.engine.add_request(
                        f"{fan.request_id}-{k}",
                        prompts[k // body.n],
                        p,
                        priority,
                        arrival,
                        stamps if k == 0 else None,  # the response's first token: choice 0's
                    )
                )
        except ValueError as exc:
            fan.close()
            raise APIError(400, str(exc), param="prompt") from exc
        except BaseException:
            fan.close()
            raise
        self.engine.profile.add("request", time.time() - stamps["handled"])
        return fan

    # --- streaming ---------------------------------------------------------------------------

    def _sse(self, events: AsyncIterator[str], fan: _Fanout) -> _SSEResponse:
        stamps = fan.streams[0].stamps if fan.streams else None
        profile = self.engine.profile

        def on_chunk_written() -> bool:
            """Stamp the first chunk with a token; True once done (or nothing to stamp)."""
            if stamps is None:
                return True
            if "dispatched" not in stamps:
                return False  # a chunk before the first token (chat's role chunk)
            stamps["written"] = time.time()
            profile.add_first_token(stamps)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("first token of %s: %s", fan.request_id, _hops_ms(stamps))
            return True

        return _SSEResponse(events, fan.close, profile, on_chunk_written)

    async def _stream_completion(self, fan: _Fanout, include_usage: bool) -> AsyncIterator[str]:
        choices = [_Choice(k // fan.n) for k in range(len(fan.streams))]
        event = _chunk_writer(fan, "text_completion", self.engine.profile)
        async for k, out in _merge(fan.streams):
            c = choices[k]
            delta_text, new_tokens = _advance(c, out)
            if not delta_text and not new_tokens and not c.finished:
                continue  # one chunk per step that produced tokens, even if no text yet
            logprobs = None
            if new_tokens and out.logprobs is not None:
                logprobs = self._completion_logprob_slice(out, new_tokens, c)
            yield event(
                {
                    "index": k,
                    "text": delta_text,
                    "logprobs": logprobs.model_dump() if logprobs is not None else None,
                    "finish_reason": out.finish_reason,
                }
            )
        for line in _stream_end(fan, choices, include_usage, CompletionResponse):
            yield line

    async def _stream_chat(
        self, fan: _Fanout, include_usage: bool, num_logprobs: int | None
    ) -> AsyncIterator[str]:
        choices = [_Choice(0) for _ in fan.streams]
        event = _chunk_writer(fan, "chat.completion.chunk", self.engine.profile)
        for k in range(len(fan.streams)):
            yield event(
                {
                    "index": k,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        async for k, out in _merge(fan.streams):
            c = choices[k]
            start_tokens = c.num_tokens_sent
            delta_text, new_tokens = _advance(c, out)
            if not delta_text and not new_tokens and not c.finished:
                continue  # one chunk per step that produced tokens, even if no text yet
            logprobs = None
            if new_tokens and num_logprobs is not None and out.logprobs is not None:
                logprobs = ChatLogprobs(
                    content=self._chat_token_logprobs(out, start_tokens, num_logprobs)
                )
            yield event(
                {
                    "index": k,
                    "delta": {"content": delta_text},
                    "logprobs": logprobs.model_dump() if logprobs is not None else None,
                    "finish_reason": out.finish_reason,
                }
            )
        for line in _stream_end(fan, choices, include_usage, ChatCompletionChunk):
            yield line

    # --- logprobs ----------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        text: str = self.tokenizer.decode([token_id])
        return text

    def _completion_logprobs(self, c: _Choice, k: int | None) -> CompletionLogprobs | None:
        if k is None or c.output is None or c.output.logprobs is None:
            return None
        c.num_tokens_sent, c.text_offset = 0, 0
        return self._completion_logprob_slice(c.output, len(c.output.token_ids), c)

    def _completion_logprob_slice(
        self, out: CompletionOutput, num_new: int, c: _Choice
    ) -> CompletionLogprobs:
        """Logprobs of the last `num_new` tokens; advances the choice's text offset."""
        result = CompletionLogprobs()
        assert out.logprobs is not None
        start = len(out.token_ids) - num_new
        for tid, lps in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            token = self._token_text(tid)
            result.tokens.append(token)
            result.token_logprobs.append(lps.get(tid))
            result.top_logprobs.append({self._token_text(t): v for t, v in _top(lps)})
            result.text_offset.append(c.text_offset)
            c.text_offset += len(token)
        return result

    def _chat_logprobs(self, c: _Choice, k: int | None) -> ChatLogprobs | None:
        if k is None or c.output is None or c.output.logprobs is None:
            return None
        return ChatLogprobs(content=self._chat_token_logprobs(c.output, 0, k))

    def _chat_token_logprobs(
        self, out: CompletionOutput, start: int, k: int
    ) -> list[ChatTokenLogprob]:
        assert out.logprobs is not None
        entries = []
        for tid, lps in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            token = self._token_text(tid)
            top = [
                TopLogprob(token=(t := self._token_text(i)), logprob=v, bytes=list(t.encode()))
                for i, v in _top(lps)[:k]
            ]
            entries.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=lps.get(tid, float("-inf")),
                    bytes=list(token.encode()),
                    top_logprobs=top,
                )
            )
        return entries


# --- helpers ---------------------------------------------------------------------------------


def _top(logprobs: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda item: item[1], reverse=True)


def _advance(c: _Choice, out: CompletionOutput) -> tuple[str, int]:
    """New text and the number of new tokens since the choice last sent; records the output."""
    delta = out.text[c.num_chars_sent :]
    new_tokens = len(out.token_ids) - c.num_tokens_sent
    c.num_chars_sent = len(out.text)
    c.num_tokens_sent = len(out.token_ids)
    c.finished = out.finish_reason is not None
    c.output = out
    return delta, new_tokens


def _field_in(message: str, candidates: dict[str, Any]) -> str | None:
    """The sampling field a SamplingParams error names, if any."""
    names = [*candidates, "stop", "stop_token_ids", "seed", "max_tokens", "logprobs"]
    return next((name for name in names if message.startswith(name) or name in message), None)


def _hops_ms(stamps: dict[str, float]) -> str:
    """ "handled 0.41 ms, sent 0.32 ms, ...": each hop of a request's way to its first token."""
    parts, previous = [], stamps["received"]
    for hop in FIRST_TOKEN_HOPS:
        parts.append(f"{hop} {(stamps[hop] - previous) * 1e3:.2f} ms")
        previous = stamps[hop]
    return ", ".join(parts)


def _chunk_writer(
    fan: _Fanout, object_name: str, profile: PhaseProfile
) -> Callable[[dict[str, Any]], str]:
    """Formats one streamed chunk with one choice. Plain dicts and a pre-serialized envelope:
    this runs for every request at every step, on the API process's event loop."""
    envelope = json.dumps(
        {"id": fan.request_id, "object": object_name, "created": fan.created, "model": fan.model},
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


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _stream_end(
    fan: _Fanout,
    choices: Sequence[_Choice],
    include_usage: bool,
    usage_chunk: type[CompletionResponse | ChatCompletionChunk],
) -> Iterator[str]:
    """What closes a stream: the usage chunk, when the client asked for it, then [DONE]."""
    if include_usage:
        usage = usage_chunk(
            id=fan.request_id,
            created=fan.created,
            model=fan.model,
            choices=[],
            usage=fan.usage(choices),
        )
        yield _sse(usage.model_dump())
    yield "data: [DONE]\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, CompletionOutput]]:
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


async def _collect(fan: _Fanout, http: Request) -> list[_Choice]:
    """Run every engine request to completion; abort them all if the client disconnects."""
    choices = [_Choice(k // fan.n) for k in range(len(fan.streams))]

    async def run() -> None:
        async for k, out in _merge(fan.streams):
            _advance(choices[k], out)

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
        fan.close()
    return choices


async def _wait_for_disconnect(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


async def _ending_in_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass events through; if the engine gives up on the request, say so in the stream."""
    try:
        async for event in events:
            yield event
    except (RequestAbortedError, EngineDeadError) as exc:
        yield _sse(error_body(str(exc), type_="service_unavailable"))
        yield "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
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
