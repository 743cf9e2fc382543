"""Block-aligned hashes of a request's prompt, the keys of prefix affinity.

The router has no tokenizer and no chat template, so it does not render the prompt the way the
engine will; it hashes a canonical form that grows the same way the rendered prompt does:

- completions: the prompt text in blocks of `block_chars` characters (token-id prompts: blocks
  of 16 ids, the engine's default KV block);
- chat: the messages in order, each as `role US content RS` (content parts' text joined, tool
  calls as JSON), concatenated and cut into the same character blocks.

Block i's hash covers every character before its end (chained: h_i = hash(h_{i-1}, block_i)),
and only full blocks count, like the engine's prefix cache. So turn n+1 of a conversation
shares all of turn n's full blocks, and requests with one system prompt share its blocks: what
the engine has cached for one, it has cached for the other, whatever its template adds around
the messages. The first block's hash is a digest of it, the same in every router process (the
prefix strategy hashes it with the replicas' names to place a prompt no router has seen, and
several routers must place it alike); the rest chain Python's `hash`, salted per process and
faster, which is fine: they never leave it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

TOKEN_BLOCK = 16  # token ids per block of a token-id prompt
# Blocks hashed at most (131,072 token ids; of text, 8,192 x block_chars characters, about as
# many tokens): a prefix shared beyond a model's context routes no better, and hashing a 50 MB
# prompt whole held the event loop, and every other stream, for seconds.
MAX_BLOCKS = 8192
# A message's content parts and tool calls read at most (the engine's own caps: 4,096 parts;
# OpenAI's 128 tools).
MAX_CONTENT_PARTS = 4096
MAX_TOOL_CALLS = 128
_UNIT, _RECORD = "\x1f", "\x1e"


def block_hashes(body: dict[str, Any], chat: bool, block_chars: int) -> list[int]:
    """The chained hashes of the full blocks of a request body's prompt (empty when it has no
    prompt the router can read: the engine then answers for it)."""
    if chat:
        messages = _canonical_messages(body.get("messages"), MAX_BLOCKS * block_chars)
        return _text_blocks(messages, block_chars)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: route on its first prompt
    if isinstance(prompt, str):
        return _text_blocks(prompt, block_chars)
    if isinstance(prompt, list):
        head = prompt[: MAX_BLOCKS * TOKEN_BLOCK]
        if all(isinstance(t, int) for t in head):
            return _token_blocks(head)
    return []


def _canonical_messages(messages: Any, most_chars: int) -> str:
    """The messages' canonical text, up to the message that passes `most_chars` (what is
    hashed: 4 MiB of 1.4 M empty messages took 1.5 s of the event loop built whole)."""
    if not isinstance(messages, list):
        return ""
    parts, chars = [], 0
    for message in messages:
        if not isinstance(message, dict):
            return ""
        role = message.get("role")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                str(part.get("text", "")) if isinstance(part, dict) else ""
                for part in content[:MAX_CONTENT_PARTS]
            )
        text = f"{role}{_UNIT}{content if isinstance(content, str) else ''}"
        calls = message.get("tool_calls")
        if calls:
            calls = calls[:MAX_TOOL_CALLS] if isinstance(calls, list) else calls
            text += json.dumps(calls, sort_keys=True, separators=(",", ":"))
        parts.append(text + _RECORD)
        chars += len(text) + 1
        if chars >= most_chars:
            break
    return "".join(parts)


def _text_blocks(text: str, block_chars: int) -> list[int]:
    if len(text) < block_chars:
        return []
    hashes = [stable_hash(text[:block_chars].encode("utf-8", "surrogatepass"))]
    chained = hashes[0]
    for end in range(2 * block_chars, min(len(text), MAX_BLOCKS * block_chars) + 1, block_chars):
        chained = hash((chained, text[end - block_chars : end]))
        hashes.append(chained)
    return hashes


def _token_blocks(ids: list[int]) -> list[int]:
    if len(ids) < TOKEN_BLOCK:
        return []
    hashes = [stable_hash(",".join(map(str, ids[:TOKEN_BLOCK])).encode())]
    chained = hashes[0]
    for end in range(2 * TOKEN_BLOCK, min(len(ids), MAX_BLOCKS * TOKEN_BLOCK) + 1, TOKEN_BLOCK):
        chained = hash((chained, tuple(ids[end - TOKEN_BLOCK : end])))
        hashes.append(chained)
    return hashes


def stable_hash(data: bytes) -> int:
    """A 64-bit hash of `data` that every process computes alike (unlike `hash`, salted per
    process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
