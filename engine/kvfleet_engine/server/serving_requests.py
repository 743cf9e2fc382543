"""From a validated OpenAI request to what the engine takes: token ids, a generation limit and
`SamplingParams` per choice. Every problem is a 400 naming the request field."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfleet_engine.server.errors import APIError, invalid_field
from kvfleet_engine.server.protocol import (
    MAX_CHOICES_PER_REQUEST,
    ChatCompletionRequest,
    SamplingFields,
)

if TYPE_CHECKING:
    from kvfleet_engine.sampling import SamplingParams


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int | None:
    """The longest text whose tokens could fit the context: max_model_len tokens of the
    vocabulary's longest (a token's vocabulary string has a character per byte, or more, of
    what it encodes, and the tokenizers of the supported families drop no text: byte-level BPE,
    SentencePiece with byte fallback). A longer prompt is refused before it is tokenized, which
    takes seconds for a few megabytes. None where the tokenizer lists no vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    longest = max((len(token) for token in get_vocab()), default=0)
    return max_model_len * max(longest, 1)


CHAT_MESSAGE_CHARS = 64  # a message's share of the chat template's own text


def prompt_chars(prompt: Any) -> int:
    """Characters of text in a completion request's prompt (token ids: none)."""
    if isinstance(prompt, str):
        return len(prompt)
    if not prompt or not isinstance(prompt[0], str):
        return 0
    return sum(len(p) for p in prompt)


def chat_chars(body: ChatCompletionRequest) -> int:
    """Characters the chat template will render for `body`, about."""
    return sum(_content_chars(m.content) + CHAT_MESSAGE_CHARS for m in body.messages)


def _content_chars(content: Any) -> int:
    """Characters of a message's content (a string or text parts), without joining them."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content)


def tokenize_prompts(tokenizer: Any, prompt: Any, max_chars: int | None) -> list[list[int]]:
    """The completion request's prompt (a string, strings, token ids, lists of token ids) as one
    list of token ids per prompt; a string longer than `max_chars` is a 400 without tokenizing
    (`prompt_char_limit`)."""
    if isinstance(prompt, str):
        return [encode(tokenizer, prompt, "prompt", add_special_tokens=True, max_chars=max_chars)]
    if not prompt:
        raise invalid_field("prompt", "must not be empty")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], list):
        return [list(p) for p in prompt]
    return [
        encode(tokenizer, p, f"prompt.{k}", add_special_tokens=True, max_chars=max_chars)
        for k, p in enumerate(prompt)
    ]


def encode(
    tokenizer: Any,
    text: str,
    field_name: str,
    add_special_tokens: bool,
    max_chars: int | None,
    split_special_tokens: bool = False,
) -> list[int]:
    """Token ids of `text` (with split_special_tokens, a special token's string in it is
    encoded as text); a 400 naming `field_name` when it is longer than any context could hold
    (`max_chars`) or the tokenizer refuses it (the protocol already refuses lone surrogates;
    this catches whatever else a tokenizer cannot encode)."""
    check_length(len(text), field_name, max_chars)
    options = {"split_special_tokens": True} if split_special_tokens else {}
    try:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens, **options)
    except Exception as exc:
        raise invalid_field(
            field_name, f"cannot be encoded by this model's tokenizer ({type(exc).__name__})"
        ) from exc
    return ids


def check_length(chars: int, field_name: str, max_chars: int | None) -> None:
    """A 400 naming `field_name` for a text of `chars` characters, more than this model's
    context could hold in any tokenization."""
    if max_chars is not None and chars > max_chars:
        raise invalid_field(
            field_name,
            f"is {chars:,} characters, more than this model's context holds in any "
            f"tokenization (at most {max_chars:,}); shorten it",
        )


def check_prompt_ids(prompts: list[list[int]], vocab_size: int) -> None:
    for k, ids in enumerate(prompts):
        if any(t >= vocab_size for t in ids):
            where = "prompt" if len(prompts) == 1 else f"prompt.{k}"
            raise invalid_field(where, f"token ids must be < {vocab_size}")


def check_num_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES_PER_REQUEST:
        raise invalid_field(
            "n",
            f"{num_prompts} prompts times n={n} is {num_prompts * n} completions; at most "
            f"{MAX_CHOICES_PER_REQUEST} per request",
        )


def generation_limit(
    body: SamplingFields,
    max_tokens: int | None,
    prompt_len: int,
    max_model_len: int,
    index: int | None = None,  # the prompt's place in a list of several
) -> int:
    """Tokens this prompt may generate: the client's limit, or whatever the context leaves."""
    field_name = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if index is not None:
        field_name += f".{index}"
    if prompt_len == 0:
        raise invalid_field(field_name, "must contain at least one token")
    if prompt_len >= max_model_len:
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


def sampling_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, choice: int, vocab_size: int
) -> SamplingParams:
    """The engine's parameters for choice `choice` of the request."""
    from kvfleet_engine.sampling import SamplingParams

    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stop_token_ids = list(body.stop_token_ids or [])
    if any(t >= vocab_size for t in stop_token_ids):
        raise invalid_field("stop_token_ids", f"token ids must be < {vocab_size}")
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
            stop_token_ids=stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            **kwargs,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param=_field_in(str(exc), kwargs)) from exc


def _field_in(message: str, candidates: dict[str, Any]) -> str | None:
    """The sampling field a SamplingParams error names, if any."""
    names = [*candidates, "stop", "stop_token_ids", "seed", "max_tokens", "logprobs"]
    return next((name for name in names if message.startswith(name) or name in message), None)
