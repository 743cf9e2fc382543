"""Bad input gets a 4xx with an OpenAI-style error naming the field; never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from serverutil import MODEL_NAME

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
        ("completions", {**GOOD, "prompt": []}, 400, "prompt"),
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
    missing = httpx.get(f"{live_server.url}/v1/nothing-here", timeout=30)
    assert missing.status_code == 404 and "error" in missing.json()
