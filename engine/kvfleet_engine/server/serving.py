"""OpenAI semantics over the engine: requests -> engine requests, outputs -> responses/chunks.

One HTTP request fans out into `len(prompts) * n` engine requests with ids `{id}-{k}`; choice k
belongs to prompt k // n. Text deltas come from the engine's cumulative (incrementally
detokenized) text, so a stream sends each character once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from kvfleet_engine.core.profile import FIRST_TOKEN_HOPS
from kvfleet_engine.server.chat_prompt import chat_prompt_ids
from kvfleet_engine.server.errors import APIError, excerpt, invalid_field
from kvfleet_engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    unsupported_fields,
)
from kvfleet_engine.server.request_log import RECORD_KEY, note
from kvfleet_engine.server.serving_logprobs import LogprobFormatter
from kvfleet_engine.server.serving_requests import (
    chat_chars,
    check_num_choices,
    check_prompt_ids,
    generation_limit,
    prompt_char_limit,
    prompt_chars,
    sampling_params,
    tokenize_prompts,
)
from kvfleet_engine.server.serving_stream import (
    Choice,
    RequestGroup,
    SSEResponse,
    advance,
    chunk_writer,
    collect,
    ending_in_error_event,
    merge,
    stream_end,
)
from kvfleet_engine.server.tokenizing import PromptTokenizer

if TYPE_CHECKING:
    from kvfleet_engine.async_engine import AsyncEngine
    from kvfleet_engine.server.state import ServerState

log = logging.getLogger(__name__)

# The ASGI scope key under which the app stamps when a request's call began (time.time()).
RECEIVED_KEY = "kvfleet.received"


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, state: ServerState) -> None:
        self.engine = engine
        self.state = state
        self.tokenizer = engine.tokenizer
        self.logprobs = LogprobFormatter(engine.tokenizer)
        self.max_prompt_chars = prompt_char_limit(engine.tokenizer, state.settings.max_model_len)
        self.tokenizing = PromptTokenizer(engine.tokenizer)

    # --- entry points ------------------------------------------------------------------------

    async def completions(
        self, body: CompletionRequest, http: Request, priority: int | None = None
    ) -> Any:
        stamps = self._first_stamps(http)
        self._check_common(body)
        prompts = await self.tokenizing.run(
            prompt_chars(body.prompt), tokenize_prompts, body.prompt, self.max_prompt_chars
        )
        group = await self._submit(
            body, prompts, body.max_tokens, body.logprobs, priority, "cmpl", stamps
        )
        note(http.scope, request_id=group.request_id)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = ending_in_error_event(self._stream_completion(group, include_usage))
            return self._sse(events, group, http)
        choices = await self._collect(group, http)
        return CompletionResponse(
            id=group.request_id,
            created=group.created,
            model=group.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=c.output.text if c.output else "",
                    logprobs=self.logprobs.completion(c.output, body.logprobs),
                    finish_reason=c.output.finish_reason if c.output else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=group.usage(choices),
        )

    async def chat(
        self, body: ChatCompletionRequest, http: Request, priority: int | None = None
    ) -> Any:
        stamps = self._first_stamps(http)
        self._check_common(body)
        prompt_ids = await self.tokenizing.run(
            chat_chars(body), chat_prompt_ids, body, self.max_prompt_chars
        )
        max_tokens = body.max_completion_tokens or body.max_tokens
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        group = await self._submit(
            body, [prompt_ids], max_tokens, num_logprobs, priority, "chatcmpl", stamps
        )
        note(http.scope, request_id=group.request_id)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = ending_in_error_event(self._stream_chat(group, include_usage, num_logprobs))
            return self._sse(events, group, http)
        choices = await self._collect(group, http)
        return ChatCompletionResponse(
            id=group.request_id,
            created=group.created,
            model=group.model,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=c.output.text if c.output else ""),
                    logprobs=self.logprobs.chat(c.output, num_logprobs),
                    finish_reason=c.output.finish_reason if c.output else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=group.usage(choices),
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
                f"model {excerpt(body.model)} does not exist; this server serves "
                f"{self.state.settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        for name, reason in unsupported_fields(body):
            raise invalid_field(name, reason)

    async def _submit(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        header_priority: int | None,
        prefix: str,
        stamps: dict[str, float],
    ) -> RequestGroup:
        settings = self.state.settings
        check_num_choices(len(prompts), body.n)
        check_prompt_ids(prompts, settings.vocab_size)
        several = len(prompts) > 1
        limits = [
            generation_limit(
                body, max_tokens, len(ids), settings.max_model_len, k if several else None
            )
            for k, ids in enumerate(prompts)
        ]
        params = [
            sampling_params(body, limits[k // body.n], logprobs, k % body.n, settings.vocab_size)
            for k in range(len(prompts) * body.n)
        ]
        # The body's field wins over the X-Priority header (a gateway may set the header).
        priority = body.priority if body.priority is not None else (header_priority or 0)
        self.state.admit(sum(len(ids) for ids in prompts) * body.n, len(params))
        arrival = time.time()
        group = RequestGroup(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(arrival),
            model=body.model,
            prompt_token_ids=prompts,
            n=body.n,
        )
        try:
            for k, p in enumerate(params):
                group.streams.append(
                    await self.engine.add_request(
                        f"{group.request_id}-{k}",
                        prompts[k // body.n],
                        p,
                        priority,
                        arrival,
                        stamps if k == 0 else None,  # the response's first token: choice 0's
                    )
                )
        except ValueError as exc:
            group.close()
            raise APIError(400, str(exc), param="prompt") from exc
        except BaseException:
            group.close()
            raise
        self.engine.profile.add("request", time.time() - stamps["handled"])
        return group

    async def _collect(self, group: RequestGroup, http: Request) -> list[Choice]:
        try:
            return await collect(group, http)
        finally:
            _note_outcome(http, group)

    # --- streaming ---------------------------------------------------------------------------

    def _sse(self, events: AsyncIterator[str], group: RequestGroup, http: Request) -> SSEResponse:
        stamps = group.streams[0].stamps if group.streams else None
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
                log.debug("first token of %s: %s", group.request_id, _hops_ms(stamps))
            return True

        def on_close() -> None:
            group.close()
            _note_outcome(http, group)

        return SSEResponse(events, on_close, profile, on_chunk_written)

    async def _stream_completion(
        self, group: RequestGroup, include_usage: bool
    ) -> AsyncIterator[str]:
        choices = group.choices = [Choice(k // group.n) for k in range(len(group.streams))]
        event = chunk_writer(group, "text_completion", self.engine.profile)
        async for k, out in merge(group.streams):
            c = choices[k]
            delta_text, new_tokens = advance(c, out)
            if not delta_text and not new_tokens and not c.finished:
                continue  # one chunk per step that produced tokens, even if no text yet
            logprobs = None
            if new_tokens and out.logprobs is not None:
                logprobs, c.text_offset = self.logprobs.completion_slice(
                    out, new_tokens, c.text_offset
                )
            yield event(
                {
                    "index": k,
                    "text": delta_text,
                    "logprobs": logprobs.model_dump() if logprobs is not None else None,
                    "finish_reason": out.finish_reason,
                }
            )
        for line in stream_end(group, choices, include_usage, CompletionResponse):
            yield line

    async def _stream_chat(
        self, group: RequestGroup, include_usage: bool, num_logprobs: int | None
    ) -> AsyncIterator[str]:
        choices = group.choices = [Choice(0) for _ in group.streams]
        event = chunk_writer(group, "chat.completion.chunk", self.engine.profile)
        for k in range(len(group.streams)):
            yield event(
                {
                    "index": k,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        async for k, out in merge(group.streams):
            c = choices[k]
            start_tokens = c.num_tokens_sent
            delta_text, new_tokens = advance(c, out)
            if not delta_text and not new_tokens and not c.finished:
                continue  # one chunk per step that produced tokens, even if no text yet
            logprobs = None
            if new_tokens and num_logprobs is not None and out.logprobs is not None:
                logprobs = ChatLogprobs(
                    content=self.logprobs.chat_tokens(out, start_tokens, num_logprobs)
                )
            yield event(
                {
                    "index": k,
                    "delta": {"content": delta_text},
                    "logprobs": logprobs.model_dump() if logprobs is not None else None,
                    "finish_reason": out.finish_reason,
                }
            )
        for line in stream_end(group, choices, include_usage, ChatCompletionChunk):
            yield line


def _note_outcome(http: Request, group: RequestGroup) -> None:
    """The request's token counts, finish reasons and TTFT, for its --log-requests line."""
    if RECORD_KEY not in http.scope:
        return
    usage = group.usage(group.choices)
    reasons = [c.output.finish_reason if c.output else None for c in group.choices]
    stamps = group.streams[0].stamps if group.streams else None
    ttft_ms = None
    if stamps is not None and "token" in stamps:
        ttft_ms = round((stamps["token"] - stamps["received"]) * 1e3, 2)
    note(
        http.scope,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        finish_reasons=reasons,
        ttft_ms=ttft_ms,
    )


def _hops_ms(stamps: dict[str, float]) -> str:
    """ "handled 0.41 ms, sent 0.32 ms, ...": each hop of a request's way to its first token."""
    parts, previous = [], stamps["received"]
    for hop in FIRST_TOKEN_HOPS:
        parts.append(f"{hop} {(stamps[hop] - previous) * 1e3:.2f} ms")
        previous = stamps[hop]
    return ", ".join(parts)
