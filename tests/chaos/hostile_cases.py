"""The hostile requests, by category: (method, path, headers, body bytes, expected param).

Expected param None: any 4xx with an OpenAI error body will do (or a 200, where the request is
odd but valid: NUL bytes in a prompt, a charset on the JSON content type).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from chaosutil import AUTH, MODEL_NAME

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GET_ROUTES = ["/health", "/ready", "/metrics", "/v1/models", "/debug/profile", "/openapi.json"]
GET_ROUTES += ["/docs"]
POST_ROUTES = [COMPLETIONS, CHAT]
JSON = {"content-type": "application/json", **AUTH}

BASE = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
CHAT_BASE = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass(frozen=True)
class Case:
    category: str
    method: str
    path: str
    body: bytes
    param: str | None  # the field the error must name; None: not checked
    headers: tuple[tuple[str, str], ...] = tuple(JSON.items())
    ok_statuses: frozenset[int] = frozenset()  # besides 4xx, statuses that are fine (200)


def _with(base: dict[str, object], field: str, raw: str) -> bytes:
    """`base` with `field` set to a raw JSON fragment (NaN, 1e400, lone surrogates...)."""
    body = json.dumps({k: v for k, v in base.items() if k != field})
    return f'{body[:-1]}, "{field}": {raw}}}'.encode()


# field -> raw JSON values no request may carry there
SAMPLING_OUT_OF_RANGE = {
    "temperature": ["-0.5", "100.5", "NaN", "Infinity", "-Infinity", "1e400", '"hot"', "[1]"],
    "top_p": ["0", "-1", "1.5", "NaN", "Infinity", '"x"'],
    "top_k": ["-2", "10" * 15, "2.5", "NaN", "{}"],
    "min_p": ["-0.1", "1.1", "NaN", "-Infinity"],
    "repetition_penalty": ["0", "-1", "10.5", "NaN", "Infinity"],
    "presence_penalty": ["-2.1", "2.1", "NaN", "-Infinity"],
    "frequency_penalty": ["-2.1", "2.1", "Infinity", "NaN"],
    "seed": ["-1", str(2**63), "1" + "0" * 30, "1.5", "NaN", '"s"'],
    "n": ["0", "-1", "129", "1e400", "2.5", "NaN"],
    "max_tokens": ["0", "-1", "1" + "0" * 30, "1.5", "NaN", "Infinity", "[]"],
    "logprobs": ["-1", "21", "1e400", '"all"'],
    "priority": [str(2**31), str(-(2**31) - 1), "1.5", "NaN"],
    "stop_token_ids": ["[-1]", "[" + "9" * 30 + "]", "[260]", '"x"', "[1.5]"],
    "stop": ["5", "[1]", '[""]', '{"a": 1}'],
    "best_of": ["0", "129", "NaN"],
    "stream": ["2", '"maybe"', "[]"],
    "ignore_eos": ['"perhaps"', "{}"],
    "stream_options": ['"x"', '{"include_usage": "x"}', '{"extra": true}'],
    "logit_bias": ['{"1": NaN}', '{"5": 1.0}', "[1]"],
}
CHAT_OUT_OF_RANGE = {
    "max_completion_tokens": ["0", "1" + "0" * 30, "NaN"],
    "top_logprobs": ["-1", "21", "NaN"],
    "logprobs": ['"yes please"', "[]"],
    "messages": ["[]", "{}", '"hi"', '[{"role": "wizard", "content": "x"}]', "[1]"],
    "response_format": ['{"type": "json_object"}', "5"],
    "tools": ['[{"type": "function"}]', '"x"'],
}


def cases() -> Iterator[Case]:
    yield from _malformed_json()
    yield from _wrong_types()
    yield from _sampling()
    yield from _surrogates_and_nul()
    yield from _token_ids()
    yield from _beyond_context()
    yield from _unknown_fields()
    yield from _methods_and_content_types()
    yield from _oversized()
    yield from _auth()


def _malformed_json() -> Iterator[Case]:
    for path, base in ((COMPLETIONS, BASE), (CHAT, CHAT_BASE)):
        good = json.dumps(base).encode()
        for cut in range(0, len(good) - 1, 3):  # truncated everywhere
            yield Case("malformed_json", "POST", path, good[:cut], "body")
        for raw in (
            good + b"}",
            good + b" trailing",
            b"\xff\xfe\xfd",
            good.replace(b'"hi"', b'"h\xffi"'),  # not UTF-8
            b"{" * 5000,
            b"[" * 100000,
            b'{"model": "a",, "prompt": "x"}',
            b"{'model': 'single quotes'}",
            b"\x00" * 64,
        ):
            yield Case("malformed_json", "POST", path, raw, "body")
        bom = b"\xef\xbb\xbf" + good  # a byte-order mark: JSON decoders may skip it
        yield Case("malformed_json", "POST", path, bom, "body", ok_statuses=frozenset({200}))


def _wrong_types() -> Iterator[Case]:
    for path in POST_ROUTES:
        for raw in (b"null", b"[]", b"[1, 2]", b"42", b'"a string"', b"true", b"{}"):
            yield Case("wrong_types", "POST", path, raw, None)
    for raw in ("null", "5", "[]", '{"name": "x"}', "true"):
        yield Case("wrong_types", "POST", COMPLETIONS, _with(BASE, "model", raw), "model")
        yield Case("wrong_types", "POST", COMPLETIONS, _with(BASE, "prompt", raw), "prompt")
    for raw in ("5", '[{"role": "user", "content": 5}]', '[{"role": "user", "content": [5]}]'):
        yield Case("wrong_types", "POST", CHAT, _with(CHAT_BASE, "messages", raw), "messages")


def _sampling() -> Iterator[Case]:
    for field_name, values in SAMPLING_OUT_OF_RANGE.items():
        for raw in values:
            yield Case(
                "sampling_out_of_range",
                "POST",
                COMPLETIONS,
                _with(BASE, field_name, raw),
                field_name,
            )
            if field_name not in ("logprobs", "best_of"):
                yield Case(
                    "sampling_out_of_range",
                    "POST",
                    CHAT,
                    _with(CHAT_BASE, field_name, raw),
                    field_name,
                )
    for field_name, values in CHAT_OUT_OF_RANGE.items():
        for raw in values:
            yield Case(
                "sampling_out_of_range", "POST", CHAT, _with(CHAT_BASE, field_name, raw), field_name
            )


SURROGATES = ['"\\ud800"', '"a\\udfffb"', '"\\udc00\\ud800"', '"ok \\ud83d"']


def _surrogates_and_nul() -> Iterator[Case]:
    for raw in SURROGATES:
        yield Case("surrogates_and_nul", "POST", COMPLETIONS, _with(BASE, "prompt", raw), "prompt")
        yield Case(
            "surrogates_and_nul",
            "POST",
            COMPLETIONS,
            _with(BASE, "prompt", f'["fine", {raw}]'),
            "prompt.1",
        )
        yield Case("surrogates_and_nul", "POST", COMPLETIONS, _with(BASE, "stop", raw), "stop")
        yield Case(
            "surrogates_and_nul",
            "POST",
            COMPLETIONS,
            _with(BASE, "stop", f'["x", {raw}]'),
            "stop.1",
        )
        yield Case("surrogates_and_nul", "POST", COMPLETIONS, _with(BASE, "model", raw), "model")
        yield Case("surrogates_and_nul", "POST", COMPLETIONS, _with(BASE, "user", raw), "user")
        yield Case(
            "surrogates_and_nul",
            "POST",
            CHAT,
            _with(CHAT_BASE, "messages", f'[{{"role": "user", "content": {raw}}}]'),
            "messages.0.content",
        )
        yield Case(
            "surrogates_and_nul",
            "POST",
            CHAT,
            _with(
                CHAT_BASE,
                "messages",
                f'[{{"role": "user", "content": [{{"type": "text", "text": {raw}}}]}}]',
            ),
            "messages.0.content.0.text",
        )
        yield Case(
            "surrogates_and_nul",
            "POST",
            CHAT,
            _with(CHAT_BASE, "messages", f'[{{"role": "user", "content": "x", "name": {raw}}}]'),
            "messages.0.name",
        )
        yield Case("surrogates_and_nul", "POST", CHAT, _with(CHAT_BASE, "stop", raw), "stop")
        yield Case(
            "surrogates_and_nul",
            "POST",
            COMPLETIONS,
            f"{json.dumps(BASE)[:-1]}, {raw}: 1}}".encode(),
            None,
        )  # as a field name
    ok = frozenset({200})
    for raw in ('"\\u0000"', '"a\\u0000b"', '"\\u0000\\u0000\\u0000"'):
        yield Case(
            "surrogates_and_nul",
            "POST",
            COMPLETIONS,
            _with(BASE, "prompt", raw),
            None,
            ok_statuses=ok,
        )
        yield Case(
            "surrogates_and_nul",
            "POST",
            COMPLETIONS,
            _with(BASE, "stop", raw),
            None,
            ok_statuses=ok,
        )
        yield Case(
            "surrogates_and_nul",
            "POST",
            CHAT,
            _with(CHAT_BASE, "messages", f'[{{"role": "user", "content": {raw}}}]'),
            None,
            ok_statuses=ok,
        )


def _token_ids() -> Iterator[Case]:
    for raw in ("[260]", "[1, 2, 99999]", "[" + "9" * 40 + "]", "[[1], [300]]", "[-1]", "[[]]"):
        yield Case(
            "token_ids_out_of_vocab", "POST", COMPLETIONS, _with(BASE, "prompt", raw), "prompt"
        )


def _beyond_context() -> Iterator[Case]:
    for size in (512, 600, 5000, 200_000):
        yield Case(
            "prompt_beyond_context",
            "POST",
            COMPLETIONS,
            _with(BASE, "prompt", json.dumps("x" * size)),
            "prompt",
        )
        yield Case(
            "prompt_beyond_context",
            "POST",
            CHAT,
            _with(CHAT_BASE, "messages", json.dumps([{"role": "user", "content": "y" * size}])),
            "messages",
        )
    yield Case(
        "prompt_beyond_context",
        "POST",
        COMPLETIONS,
        _with(BASE, "prompt", json.dumps(list(range(200)) * 3)),
        "prompt",
    )
    yield Case(
        "prompt_beyond_context", "POST", COMPLETIONS, _with(BASE, "max_tokens", "511"), "max_tokens"
    )
    yield Case(
        "prompt_beyond_context",
        "POST",
        COMPLETIONS,
        _with(BASE, "prompt", json.dumps(["a"] * 300)),
        "prompt",
    )  # too many prompts
    yield Case(
        "prompt_beyond_context",
        "POST",
        COMPLETIONS,
        json.dumps({**BASE, "prompt": ["a"] * 100, "n": 3}).encode(),
        "n",
    )


def _unknown_fields() -> Iterator[Case]:
    for name in ("frobnicate", "Model", "max_token", "__proto__", "prompt ", ""):
        yield Case("unknown_fields", "POST", COMPLETIONS, _with(BASE, name, "1"), name or None)
        yield Case("unknown_fields", "POST", CHAT, _with(CHAT_BASE, name, "1"), name or None)
    yield Case(
        "unknown_fields",
        "POST",
        CHAT,
        _with(CHAT_BASE, "messages", '[{"role": "user", "content": "x", "mood": 1}]'),
        "messages.0.mood",
    )
    yield Case(
        "unknown_fields",
        "POST",
        COMPLETIONS,
        json.dumps({**BASE, "stream": True, "stream_options": {"x": 1}}).encode(),
        "stream_options.x",
    )


def _methods_and_content_types() -> Iterator[Case]:
    for path in POST_ROUTES:
        for method in ("GET", "PUT", "DELETE", "PATCH"):
            yield Case("wrong_method", method, path, b"", None)
    for path in GET_ROUTES:
        for method in ("POST", "PUT", "DELETE"):
            yield Case("wrong_method", method, path, json.dumps(BASE).encode(), None)
    yield Case("wrong_method", "GET", "/v1/nothing-here", b"", None)
    good = json.dumps(BASE).encode()
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/xml",
        "multipart/form-data; boundary=x",
        "",
        "application/json; charset=utf-8",
        "application/json; charset=latin-1",
    ):
        headers = tuple({**AUTH, "content-type": content_type}.items())
        yield Case("wrong_content_type", "POST", COMPLETIONS, good, None, headers, frozenset({200}))
    headers = tuple({**JSON, "content-encoding": "gzip"}.items())
    yield Case("wrong_content_type", "POST", COMPLETIONS, b"\x1f\x8bnot really gzip", None, headers)


def _oversized() -> Iterator[Case]:
    for path in POST_ROUTES:
        for size in (1024 * 1024 + 1, 3 * 1024 * 1024):
            body = _with(BASE, "prompt", json.dumps("z" * size))
            yield Case("oversized_body", "POST", path, body, "body")
    for path in GET_ROUTES:
        yield Case("oversized_body", "POST", path, b"0" * (2 * 1024 * 1024), "body")


def _auth() -> Iterator[Case]:
    good = json.dumps(BASE).encode()
    bad = [
        "",
        "Bearer",
        "Bearer wrong",
        f"Basic {AUTH['Authorization'][7:]}",
        AUTH["Authorization"] + "x",
        AUTH["Authorization"][:-1],
        "Bearer " + "k" * 8000,
    ]
    for value in bad:
        headers = (("content-type", "application/json"), ("authorization", value))
        for path in [*POST_ROUTES, "/v1/models", "/debug/profile", "/openapi.json", "/docs"]:
            method = "POST" if path in POST_ROUTES else "GET"
            yield Case("auth", method, path, good if method == "POST" else b"", None, headers)
    for path in [*POST_ROUTES, "/v1/models"]:
        method = "POST" if path in POST_ROUTES else "GET"
        yield Case("auth", method, path, good, None, (("content-type", "application/json"),))
