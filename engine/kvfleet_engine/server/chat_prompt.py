"""A chat request's messages through the model's chat template, as token ids, with what clients
wrote kept as text: a special token's string inside a message (`<|im_end|>`, `<|eot_id|>`, ...)
is encoded as the characters it is, never as that token, so a message cannot close its own turn
and forge another (a system turn, say), as OpenAI's API does not let it. The template's own
special tokens are tokens as always.

Messages without such a string are rendered and encoded as one text, exactly as before (the
tokens every reference tokenizer gives). A message with one is rendered as a placeholder, and
the rendered text is encoded piece by piece: the template's pieces with special tokens, the
message's text with `split_special_tokens`."""

from __future__ import annotations

import functools
import re
import uuid
from typing import Any

from kvfleet_engine.server.errors import invalid_field
from kvfleet_engine.server.protocol import ChatCompletionRequest
from kvfleet_engine.server.serving_requests import check_length, encode


def chat_prompt_ids(
    tokenizer: Any, body: ChatCompletionRequest, max_chars: int | None
) -> list[int]:
    """The conversation through the model's chat template, as token ids (a rendered text longer
    than `max_chars`: a 400 without tokenizing)."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid_field("messages", "this model has no chat template; use /v1/completions")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    special = special_token_pattern(tokenizer)
    held: dict[str, tuple[int, str, str]] = {}  # placeholder -> (message, its text, a token)
    tag = uuid.uuid4().hex  # no client can have written it
    for k, message in enumerate(messages):
        found = special.search(message["content"]) if special is not None else None
        if found is not None:
            placeholder = f"\ue000{tag}.{k}\ue001"
            held[placeholder] = (k, message["content"], found[0])
            message["content"] = placeholder
    text = _render(tokenizer, messages, body.add_generation_prompt)
    if not held:
        return encode(tokenizer, text, "messages", add_special_tokens=False, max_chars=max_chars)
    pieces = re.split(f"(\ue000{tag}[.][0-9]+\ue001)", text)
    for placeholder, (k, _, token) in held.items():
        if pieces.count(placeholder) != 1:  # the template changed or repeated the text
            raise invalid_field(
                f"messages.{k}.content",
                f"holds the special token {token!r}, which this model's chat template cannot "
                "take as text",
            )
    chars = sum(len(held[piece][1]) if piece in held else len(piece) for piece in pieces)
    check_length(chars, "messages", max_chars)
    ids: list[int] = []
    for piece in pieces:
        if piece in held:
            k, content, _ = held[piece]
            ids += encode(
                tokenizer, content, f"messages.{k}.content", add_special_tokens=False,
                max_chars=None, split_special_tokens=True,
            )  # fmt: skip
        elif piece:
            ids += encode(tokenizer, piece, "messages", add_special_tokens=False, max_chars=None)
    return ids


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja raises on conversations the template forbids
        raise invalid_field("messages", f"rejected by the chat template: {exc}") from exc
    return str(text)


@functools.cache
def special_token_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A pattern of the tokenizer's special tokens' strings (None: it has none); made once per
    tokenizer (a server has one)."""
    strings = set(getattr(tokenizer, "all_special_tokens", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    strings.update(token.content for token in decoder.values() if getattr(token, "special", 0))
    strings.discard("")
    if not strings:
        return None
    # Longest first, so a token that extends another is found whole.
    return re.compile("|".join(map(re.escape, sorted(strings, key=lambda s: (-len(s), s)))))
