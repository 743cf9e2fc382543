"""GET /debug/profile: where each serving process's time goes, and the hops and waits one
request takes on its way to its first token (counts, not timings: a regression that adds a
hop, a poll or an empty round trip changes them)."""

from __future__ import annotations

import time

import httpx
from serverutil import MODEL_NAME, metric, scrape

from kvfleet_engine.bench.profile_split import split_of
from kvfleet_engine.core.profile import FIRST_TOKEN_HOPS

MAX_TOKENS = 4


def _profile(url: str) -> dict:  # type: ignore[type-arg]
    response = httpx.get(f"{url}/debug/profile", timeout=30)
    assert response.status_code == 200
    body: dict = response.json()  # type: ignore[type-arg]
    return body


def _wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until the core reports nothing running or waiting (an earlier test's request may still
    be finishing, or its abort on its way)."""
    label = f'{{model_name="{MODEL_NAME}"}}'
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(url)
        busy = metric(text, f"vllm:num_requests_running{label}") + metric(
            text, f"vllm:num_requests_waiting{label}"
        )
        if busy == 0:
            return
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


def _stream(url: str, body: dict) -> list[str]:  # type: ignore[type-arg]
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.startswith("data: {")]


def test_one_request_on_an_idle_server_takes_one_record_per_token(live_server) -> None:  # type: ignore[no-untyped-def]
    url = live_server.url
    body = {
        "model": MODEL_NAME,
        "prompt": [5, 6, 7, 8, 9, 10, 11, 12],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    _wait_idle(url)
    before = _profile(url)
    chunks = _stream(url, body)
    split = split_of(before, _profile(url))
    api, core = split["api"], split["core"]
    core_counts = {name: phase["count"] for name, phase in core["phases"].items()}
    api_counts = {name: phase["count"] for name, phase in api["phases"].items()}

    # A chunk per step, unless the stream coalesced steps that piled up before it was read.
    assert 1 <= len(chunks) <= MAX_TOKENS
    # The idle core blocked twice (before the request, before the second profile call) and
    # woke once per command: it does not poll.
    assert core_counts["idle"] == 2
    assert core_counts["commands"] == 2  # the AddRequest and the profile call
    # One step per token, each reported in one record; the first step's record carries the
    # first token (async scheduling: the prefill, then one decode launch per further token).
    assert core_counts["output"] == MAX_TOKENS
    assert core_counts["launch"] == MAX_TOKENS
    assert core_counts["send"] == MAX_TOKENS + 1  # the steps and the profile call's result
    assert api_counts["records"] == MAX_TOKENS + 1
    assert api_counts["write"] == len(chunks) + 1  # each chunk written once, then [DONE]
    assert api_counts["parse"] == api_counts["request"] == 1

    # The first token's way, hop by hop, in order: every stamp after the one before it
    # (one machine's clock; the core's stamps are its own process's time.time()).
    assert api["num_first_tokens"] == 1
    hops = api["first_token_ms"]
    assert list(hops) == list(FIRST_TOKEN_HOPS)
    assert all(ms >= 0 for ms in hops.values()), hops


def test_the_profile_reports_both_processes(live_server) -> None:  # type: ignore[no-untyped-def]
    body = _profile(live_server.url)
    assert body["api"]["role"] == "api" and body["core"]["role"] == "core"
    assert body["api"]["pid"] != body["core"]["pid"]
    assert set(body["core"]["phases"]) >= {"idle", "schedule", "launch", "collect", "send"}
    assert set(body["api"]["phases"]) >= {"parse", "records", "outputs", "chunks", "write"}
    assert body["core"]["cpu_s"] > 0 and body["core"]["num_cpus"] >= 1
