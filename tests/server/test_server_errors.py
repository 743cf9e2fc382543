"""Bad input gets a 4xx with an OpenAI-style error naming the field; never a 500."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from serverutil import MODEL_NAME

from kvfleet_engine.server import tokenizing

GOOD = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
        ("completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
        ("completions", {**GOOD, "prompt": "x" * 600}, 400, "prompt"),
        ("completions", {**GOOD, "max_tokens": 600}, 400, "max_tokens"),
        ("completions", {**GOOD, "prompt": [1, 99999]}, 400, "prompt"),
        ("completions", {**GOOD, "prompt": [[1], [2, 99999]]}, 400, "prompt.1"),
        ("completions", {**GOOD, "prompt": []}, 400, "prompt"),
        ("completions", {**GOOD, "prompt": ["a", ""]}, 400, "prompt.1"),
        ("completions", {**GOOD, "prompt": ["hi", "x" * 600]}, 400, "prompt.1"),
        ("completions", {**GOOD, "temperature": -1}, 400, "temperature"),
        ("completions", {**GOOD, "top_p": 0}, 400, "top_p"),
        ("completions", {**GOOD, "n": 0}, 400, "n"),
        ("completions", {**GOOD, "echo": True}, 400, "echo"),
        ("completions", {**GOOD, "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
        ("completions", {**GOOD, "best_of": 3}, 400, "best_of"),
        ("completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
        ("completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("completions", {"model": MODEL_NAME}, 400, "prompt"),
        ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
        ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
        ("chat/completions", {**CHAT, "max_completion_tokens": 600}, 400, "max_completion_tokens"),
        ("chat/completions", {**CHAT, "messages": [{"role": "wizard"}]}, 400, "messages.0.role"),
        (
            "chat/completions",
            {**CHAT, "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        # a user turn without content was rendered as an empty one
        (
            "chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": None}]},
            400,
            "messages.0.content",
        ),
        # an empty or padded response_format was accepted and ignored
        ("chat/completions", {**CHAT, "response_format": {}}, 400, "response_format"),
        (
            "chat/completions",
            {**CHAT, "response_format": {"type": "text", "schema": {}}},
            400,
            "response_format",
        ),
    ],
)
def test_bad_request_names_the_field(
    live_server, path: str, body: dict[str, Any], status: int, param: str
) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(f"{live_server.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"] and error["type"]


def test_malformed_json_and_unknown_route(live_server) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(
        f"{live_server.url}/v1/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(
        f"{live_server.url}/v1/completions",
        content=b'{"model": "m", "prompt": "hi",, "n": 1}',
        headers={"content-type": "application/json"},
        timeout=30,
    )  # where and why, not only "JSON decode error"
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "at character 30" in message, message
    missing = httpx.get(f"{live_server.url}/v1/nothing-here", timeout=30)
    assert missing.status_code == 404 and "error" in missing.json()


TOKEN_FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        # JSON's own types only: no strings for numbers, no numbers for booleans or token ids
        ("completions", {**GOOD, "max_tokens": "5"}, "max_tokens", "valid integer"),
        ("completions", {**GOOD, "stream": "yes"}, "stream", "valid boolean"),
        ("completions", {**GOOD, "n": 1.0}, "n", "valid integer"),
        ("completions", {**GOOD, "prompt": [True, False]}, "prompt", TOKEN_FORMS),
        ("completions", {**GOOD, "prompt": [1.0, 2.0]}, "prompt", TOKEN_FORMS),
        ("completions", {**GOOD, "temperature": "0.5"}, "temperature", "valid number"),
        # a union field that gets none of its forms says all of them
        ("completions", {**GOOD, "prompt": 5}, "prompt", TOKEN_FORMS),
        ("completions", {**GOOD, "prompt": None}, "prompt", TOKEN_FORMS),
        ("completions", {**GOOD, "prompt": [[[1]]]}, "prompt", TOKEN_FORMS),
        ("completions", {**GOOD, "prompt": [1, "a"]}, "prompt", TOKEN_FORMS),
        ("completions", {**GOOD, "stop": [1, 2]}, "stop", "must be a string or a list of strings"),
        (
            "chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
            'must be a string, a list of {"type": "text", "text": "..."} parts, or null',
        ),
        # stop strings are bounded in number and length, messages in number
        ("completions", {**GOOD, "stop": ["x"] * 17}, "stop", "at most 16 items"),
        ("completions", {**GOOD, "stop": "x" * 1025}, "stop", "at most 1024 characters"),
        ("completions", {**GOOD, "stop": ["x", ""]}, "stop.1", "at least 1 character"),
        ("chat/completions", {**CHAT, "messages": CHAT["messages"] * 4097}, "messages", "4096"),
    ],
)
def test_a_value_of_the_wrong_type_or_size_is_named_with_what_the_field_takes(
    live_server, path: str, body: dict[str, Any], param: str, message: str
) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(f"{live_server.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and message in error["message"], error


def test_an_unknown_model_s_name_is_quoted_cut_short(live_server) -> None:  # type: ignore[no-untyped-def]
    """3 MB of model name came back as 3 MB of error."""
    r = httpx.post(
        f"{live_server.url}/v1/completions", json={**GOOD, "model": "x" * 3_000_000}, timeout=30
    )
    assert r.status_code == 404, r.text[:300]
    message = r.json()["error"]["message"]
    assert len(message) < 400
    assert message.startswith(f"model {'x' * 256!r}... (3,000,000 characters) does not exist")


def test_numbers_that_are_still_accepted(live_server) -> None:  # type: ignore[no-untyped-def]
    """An integer for a float field is a number all the same; the stop strings' bound is 16."""
    body = {**GOOD, "temperature": 1, "top_p": 1, "stop": ["x" * 1024] * 16, "prompt": [1, 2]}
    r = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("content", "param", "message"),
    [
        ('{"model": "m", "prompt": "hi", "temperature": NaN}', "temperature", "finite number"),
        ('{"model": "m", "prompt": "hi", "top_p": Infinity}', "top_p", "finite number"),
        (
            '{"model": "m", "prompt": "hi", "logit_bias": {"\\ud800": 1}}',
            "logit_bias",
            "lone UTF-16 surrogate",
        ),
        ('{"model": "m", "prompt": "hi", "stop": ["x", "\\ud800"]}', "stop.1", "lone UTF-16"),
        ('{"model": "m", "prompt": "hi", "seed": ' + "9" * 5000 + "}", "body", "4300 digits"),
        ("[" * 100_000 + "]" * 100_000, "body", "nests arrays or objects too deeply"),
        (b'{"model": "\xff"}', "body", "not UTF-8 text (invalid byte at offset 11)"),
        ("", "body", "request body is empty: send a JSON object with Content-Type"),
        ("[1]", "body", "must be a JSON object: send a JSON object with Content-Type"),
        (  # an object key pydantic cannot read: "must be a JSON object" had said
            '{"\\ud800": 1, "model": "m", "prompt": "hi"}',
            "body",
            "request body is not valid: an object key holds a lone UTF-16 surrogate",
        ),
    ],
)
def test_json_the_server_cannot_take_is_explained(
    live_server, content: str | bytes, param: str, message: str
) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(
        f"{live_server.url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_sent_as_something_other_than_json_says_to_send_json(
    live_server, content_type: str | None
) -> None:  # type: ignore[no-untyped-def]
    headers = {} if content_type is None else {"content-type": content_type}
    content = json.dumps(GOOD)
    r = httpx.post(f"{live_server.url}/v1/completions", content=content, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "body", error
    given = f"Content-Type: {content_type}" if content_type else "no Content-Type"
    assert f"({given})" in error["message"]
    assert "send a JSON object with Content-Type: application/json" in error["message"]


def test_a_prompt_no_context_could_hold_is_refused_before_it_is_tokenized(
    live_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """3 MB of prompt: before, its tokenization held the event loop for seconds (a liveness
    probe timed out); now its length alone refuses it, naming the field."""
    encoded: list[int] = []
    monkeypatch.setattr(  # on the class: the engine's tokenizer and the worker's copy
        type(live_server.state.engine.tokenizer),
        "encode",
        lambda self, text, **kw: encoded.append(len(text)) or [1],
    )
    for path, body, param in [
        ("completions", {**GOOD, "prompt": "x" * 3_000_000}, "prompt"),
        ("completions", {**GOOD, "prompt": ["hi", "x" * 3_000_000]}, "prompt.1"),
        ("chat/completions",
         {**CHAT, "messages": [{"role": "user", "content": "x" * 3_000_000}]}, "messages"),
    ]:  # fmt: skip
        r = httpx.post(f"{live_server.url}/v1/{path}", json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "characters" in error["message"], error
    assert all(n < 100 for n in encoded)  # only "hi" was tokenized


LONG_PROMPT = "hello " * 50  # past the inline bound the tests set (the tiny model's context
INLINE_CHARS_IN_TESTS = 100  # holds no prompt past the real one, 8,192 characters)


def test_a_slow_tokenization_does_not_hold_health_or_other_requests(
    live_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """Long prompts are tokenized off the event loop: while one takes long, /health answers."""
    import threading

    monkeypatch.setattr(tokenizing, "INLINE_TOKENIZE_CHARS", INLINE_CHARS_IN_TESTS)
    tokenizer_type = type(live_server.state.engine.tokenizer)
    original, release = tokenizer_type.encode, threading.Event()

    def slow_encode(self, text, **kw):  # type: ignore[no-untyped-def]
        release.wait(20)
        return original(self, text, **kw)

    monkeypatch.setattr(tokenizer_type, "encode", slow_encode)
    with httpx.Client(timeout=30) as client:
        done: dict[str, Any] = {}
        url, body = f"{live_server.url}/v1/completions", {**GOOD, "prompt": LONG_PROMPT}
        request = threading.Thread(target=lambda: done.update(r=client.post(url, json=body)))
        request.start()
        try:
            health = httpx.get(f"{live_server.url}/health", timeout=2)
            assert health.status_code == 200 and request.is_alive()
        finally:
            release.set()
            request.join(30)
    assert done["r"].status_code == 200, done["r"].text


def test_short_prompts_are_tokenized_on_the_loop_long_ones_by_the_worker_s_own_copy(
    live_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A hop to the tokenizing thread waits for the GIL behind the busy loop (18.8 ms per first
    token at 256 streams on an H100): short prompts skip it. The worker's tokenizer is a copy,
    so it never runs inside the same Rust object as the loop's detokenizing."""
    import threading

    monkeypatch.setattr(tokenizing, "INLINE_TOKENIZE_CHARS", INLINE_CHARS_IN_TESTS)
    engine_tokenizer = live_server.state.engine.tokenizer
    tokenizer_type = type(engine_tokenizer)
    original, seen = tokenizer_type.encode, []

    def recording_encode(self, text, **kw):  # type: ignore[no-untyped-def]
        seen.append((len(text), threading.current_thread().name, self is engine_tokenizer))
        return original(self, text, **kw)

    monkeypatch.setattr(tokenizer_type, "encode", recording_encode)
    for prompt in ("hi", LONG_PROMPT):
        r = httpx.post(
            f"{live_server.url}/v1/completions", json={**GOOD, "prompt": prompt}, timeout=30
        )
        assert r.status_code == 200, r.text
    (short_len, short_thread, short_own), (long_len, long_thread, long_own) = seen
    assert short_len == 2 and not short_thread.startswith("kvfleet-tokenize") and short_own
    assert long_len == len(LONG_PROMPT) and long_thread.startswith("kvfleet-tokenize")
    assert not long_own


def test_a_compressed_body_is_415_not_a_confusing_400(live_server) -> None:  # type: ignore[no-untyped-def]
    """A gzip body was read as JSON: "not UTF-8 text (invalid byte at offset 1)"."""
    import gzip

    r = httpx.post(
        f"{live_server.url}/v1/completions",
        content=gzip.compress(json.dumps(GOOD).encode()),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=30,
    )
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_content_encoding" and "'gzip'" in error["message"]
    plain = httpx.post(
        f"{live_server.url}/v1/completions",
        json=GOOD,
        headers={"content-encoding": "identity"},
        timeout=30,
    )
    assert plain.status_code == 200, plain.text
