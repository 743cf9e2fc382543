"""Incremental detokenization with stop strings.

Each new token re-decodes only a short window (the tokens since the last emitted text), so the
cost per token does not grow with the output. A byte-level token that ends inside a multi-byte
character is held back until the character completes. While running, the text also holds back
the last (longest stop string - 1) characters, so a stop string is never streamed in part.

When nobody reads the text before the end (no stop strings, no streaming consumer), the engine
skips the per-token work and calls `decode_all` once at finish: one decode of the whole output
(after the same prompt context), which is what the token-by-token text adds up to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfleet_engine.sampling import SamplingParams

# Prompt tokens decoded with the first output tokens (some tokenizers need left context,
# e.g. to decide on a leading space).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.prefix_text: str | None = None  # decode of token_ids[prefix_offset:read_offset]
        self.decode = _decoder(tokenizer, params.skip_special_tokens)
        self.text = ""
        self.stop_buffer = max((len(s) for s in params.stop), default=1) - 1
        self.finished = False

    def update(self, new_token_ids: list[int], final: bool = False) -> str | None:
        """Add generated tokens; returns the stop string that matched (text is cut before it).
        final: these are the last tokens, so bytes of an incomplete character are flushed."""
        for index, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            delta = self._decode_delta(final and index == len(new_token_ids) - 1)
            if not delta:
                continue
            checked_from = max(len(self.text) - self.stop_buffer, 0)
            self.text += delta
            stop = self._find_stop(checked_from)
            if stop is not None:
                return stop
        return None

    def decode_all(self, output_token_ids: list[int]) -> str:
        """The whole text of these generated tokens at once (in place of `update` per token;
        no stop strings, so there is nothing to look for)."""
        assert not self.params.stop, "stop strings need update() token by token"
        context = self.token_ids[: self.read_offset]
        prefix = self.decode(context) if context else ""
        full = self.decode([*context, *output_token_ids])
        self.text = full[len(prefix) :]
        return self.text

    def output_text(self, finished: bool) -> str:
        """The text so far; while running, minus the tail a stop string could still claim."""
        if finished or self.stop_buffer == 0:
            return self.text
        return self.text[: max(len(self.text) - self.stop_buffer, 0)]

    def _decode_delta(self, final: bool) -> str:
        ids = self.token_ids
        if self.prefix_text is None:
            self.prefix_text = self.decode(ids[self.prefix_offset : self.read_offset])
        prefix = self.prefix_text
        full = self.decode(ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self.prefix_text = None
        return full[len(prefix) :]

    def _find_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self.text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """token ids -> text. A fast tokenizer's Rust decoder is called directly (several times
    cheaper per call) unless the tokenizer also cleans up spaces, which only its decode() does."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
