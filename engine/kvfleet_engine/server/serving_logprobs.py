"""Logprobs in OpenAI's two shapes: completions' parallel lists and chat's per-token entries."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfleet_engine.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from kvfleet_engine.tokenizer import TokenBytes

if TYPE_CHECKING:
    from kvfleet_engine.outputs import CompletionOutput


class LogprobFormatter:
    """Turns a choice's token ids and logprob dicts into response logprobs (token texts come
    from decoding each id alone; chat's `bytes` are each token's own, `TokenBytes`: a token that
    holds part of a character decodes alone to U+FFFD)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes = TokenBytes(tokenizer)

    def completion(self, out: CompletionOutput | None, k: int | None) -> CompletionLogprobs | None:
        """A whole choice's logprobs (non-streaming completions)."""
        if k is None or out is None or out.logprobs is None:
            return None
        logprobs, _ = self.completion_slice(out, len(out.token_ids), 0)
        return logprobs

    def completion_slice(
        self, out: CompletionOutput, num_new: int, text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Logprobs of the last `num_new` tokens, their text starting at `text_offset`; and
        the offset after them."""
        result = CompletionLogprobs()
        assert out.logprobs is not None
        start = len(out.token_ids) - num_new
        for tid, lps in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            token = self._token_text(tid)
            result.tokens.append(token)
            result.token_logprobs.append(lps.get(tid))
            result.top_logprobs.append({self._token_text(t): v for t, v in _top(lps)})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result, text_offset

    def chat(self, out: CompletionOutput | None, k: int | None) -> ChatLogprobs | None:
        """A whole choice's logprobs (non-streaming chat)."""
        if k is None or out is None or out.logprobs is None:
            return None
        return ChatLogprobs(content=self.chat_tokens(out, 0, k))

    def chat_tokens(self, out: CompletionOutput, start: int, k: int) -> list[ChatTokenLogprob]:
        """Entries for the choice's tokens from `start` on, each with its top `k`."""
        assert out.logprobs is not None
        entries = []
        for tid, lps in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            token = self._token_text(tid)
            top = [
                TopLogprob(token=self._token_text(i), logprob=v, bytes=list(self._bytes(i)))
                for i, v in _top(lps)[:k]
            ]
            entries.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=lps.get(tid, float("-inf")),
                    bytes=list(self._bytes(tid)),
                    top_logprobs=top,
                )
            )
        return entries

    def _token_text(self, token_id: int) -> str:
        text: str = self.tokenizer.decode([token_id])
        return text


def _top(logprobs: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda item: item[1], reverse=True)
