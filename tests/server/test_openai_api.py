"""The official `openai` client, unchanged, against the real server and tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from serverutil import MODEL_NAME


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_completion_with_usage_logprobs_and_n(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=5, n=2, logprobs=2, seed=7, temperature=1.0
    )
    assert [c.index for c in result.choices] == [0, 1]
    for choice in result.choices:
        assert choice.finish_reason == "length"
        assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 5
        assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs or [])
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(b"Hello")  # one token per byte
    assert result.usage.completion_tokens == 10
    again = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=5, n=2, seed=7, temperature=1.0
    )
    assert [c.text for c in again.choices] == [c.text for c in result.choices]  # seeded


def test_greedy_completion_streams_the_same_text(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=12, temperature=0)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="abc",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_stop_string_ends_the_completion(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt="xy", max_tokens=16, temperature=0)
    text = whole.choices[0].text
    stop = next((ch for ch in text[2:] if ch.isprintable() and ch != "\ufffd"), None)
    if stop is None:
        pytest.skip("greedy text of the tiny model has no printable character to stop on")
    cut = client.completions.create(
        model=MODEL_NAME, prompt="xy", max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_chat_completion_and_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage is not None and whole.usage.prompt_tokens > 10  # the template applied
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    lps = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert len(lps) == whole.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in lps)
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    )


def test_sse_wire_format_ends_with_done(live_server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
    body["ignore_eos"] = True  # sampled: the tiny model ends ~1% of such streams on EOS
    with httpx.stream("POST", f"{live_server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_priority_field_and_header_are_accepted(live_server) -> None:  # type: ignore[no-untyped-def]
    url = f"{live_server.url}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "p", "max_tokens": 2}
    assert httpx.post(url, json={**body, "priority": -5}, timeout=60).status_code == 200
    assert httpx.post(url, json=body, headers={"X-Priority": "3"}, timeout=60).status_code == 200
    bad = httpx.post(url, json=body, headers={"X-Priority": "high"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Priority"


def test_bench_serve_against_the_server(live_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from kvfleet_engine.bench.serve import main

    out = tmp_path / "bench.json"
    argv = ["--url", live_server.url, "--concurrency", "2", "--num-prompts", "4"]
    argv += ["--random-input-len", "16", "--random-output-len", "6", "--no-progress"]
    argv += ["--goodput", "ttft:60000", "--output", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    results = record["results"]
    assert results["completed"] == 4 and results["failed"] == 0
    assert results["total_output_tokens"] == 24 and results["total_input_tokens"] == 64
    assert results["ttft_ms"]["p50"] > 0 and results["itl_ms"]["p99"] > 0
    assert results["request_goodput"] > 0
    assert record["command"].startswith("kvfleet bench serve --url")


def test_streamed_choices_of_n_arrive_interleaved_and_all_finish(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=6, n=3, seed=1, stream=True
    )
    tokens_by_choice: dict[int, int] = {}
    finished: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            tokens_by_choice[choice.index] = tokens_by_choice.get(choice.index, 0) + 1
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert all(count >= 1 for count in tokens_by_choice.values())


def test_chat_logprob_bytes_are_each_tokens_own(live_server) -> None:  # type: ignore[no-untyped-def]
    """The tiny model's tokens are single bytes; one that holds part of a UTF-8 character
    decodes alone to U+FFFD. Its `bytes` are its own byte, not U+FFFD's three (the field exists
    so that clients can join such tokens back into text)."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "héllo wörld"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
    }
    r = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["logprobs"]["content"]
    candidates = [top for entry in entries for top in entry["top_logprobs"]]
    partial = [top for top in candidates if top["token"] == "\ufffd"]
    assert partial, "no top candidate was a lone byte of a multi-byte character"
    assert all(len(top["bytes"]) == 1 and top["bytes"][0] >= 0x80 for top in partial), partial
    whole = [top for top in candidates if top["token"] != "\ufffd"]
    assert all(bytes(top["bytes"]).decode() == top["token"] for top in whole)
