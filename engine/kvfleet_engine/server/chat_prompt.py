"""A chat request's messages through the model's chat template, as token ids, with what clients
wrote kept as text: a special token's string inside a message (`<|im_end|>`, `<|eot_id|>`, ...)
is encoded as the characters it is, never as that token, so a message cannot close its own turn
and forge another (a system turn, say), as OpenAI's API does not let it. The template's own
special tokens are tokens as always.

Messages without such a string are rendered and encoded as one text, exactly as before (the
tokens every reference tokenizer gives). In a message with one, each such string is replaced by
a marker of its own (the template sees the rest of the text as it is: trims it, cuts it), and
the rendered text is encoded as the tokenizer encodes any text, split at its special tokens
first, here the template's only, each stretch between them alone, with the markers' strings put
back and encoded as text (`split_special_tokens`)."""

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
    """The conversation through the model's chat template, as token ids (a text longer than
    `max_chars`: a 400 without searching or tokenizing it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid_field("messages", "this model has no chat template; use /v1/completions")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    check_length(sum(len(m["content"]) for m in messages), "messages", max_chars)
    special = special_token_pattern(tokenizer)
    marker_of: dict[str, str] = {}  # a special token's string a message held -> its marker
    tag = uuid.uuid4().hex  # no client can have written it
    if special is not None:

        def marked(match: re.Match[str]) -> str:
            return marker_of.setdefault(match[0], f"\ue000{tag}.{len(marker_of)}\ue001")

        for message in messages:
            message["content"] = special.sub(marked, message["content"])
    text = _render(tokenizer, messages, body.add_generation_prompt)
    if not marker_of:
        return encode(tokenizer, text, "messages", add_special_tokens=False, max_chars=max_chars)
    assert special is not None
    check_length(len(text), "messages", max_chars)
    markers = {marker: string for string, marker in marker_of.items()}
    marker = re.compile(f"\ue000{tag}[.][0-9]+\ue001")
    ids: list[int] = []
    for k, piece in enumerate(special.split(text)):  # text, token, text, ..., text
        if k % 2:  # one of the template's special tokens
            ids += encode(tokenizer, piece, "messages", add_special_tokens=False, max_chars=None)
        elif piece:
            piece = marker.sub(lambda found: markers[found[0]], piece)
            ids += encode(
                tokenizer, piece, "messages", add_special_tokens=False, max_chars=None,
                split_special_tokens=True,
            )  # fmt: skip
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
    """One group matching any of the tokenizer's special tokens' strings, the longest at a
    place (None: it has none); made once per tokenizer (a server has one). A prefix tree, so a
    search is linear in the text: Llama 3's 256 strings as an alternation took 2.4 s over 4 MiB
    of "<|reserved_special_token_"."""
    strings = set(getattr(tokenizer, "all_special_tokens", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    strings.update(token.content for token in decoder.values() if getattr(token, "special", 0))
    strings.discard("")
    if not strings:
        return None
    trie: dict[str, Any] = {}
    for string in strings:
        node = trie
        for char in string:
            node = node.setdefault(char, {})
        node[""] = {}  # a string ends here
    return re.compile(f"({_alternatives(trie)})")


def _alternatives(node: dict[str, Any]) -> str:
    """The pattern of a prefix tree's strings below `node`; a longer match first."""
    branches = [re.escape(char) + _alternatives(child) for char, child in node.items() if char]
    if not branches:
        return ""
    either = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
    return f"(?:{either})?" if "" in node else either
