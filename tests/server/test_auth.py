"""--api-key with the official openai client, the request body limit, and --log-requests: one
JSON line per request, never the key, the prompt or the completion."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from serverutil import MODEL_NAME, LiveServer, serve_in_thread

API_KEY = "sk-test-5e1f0c9a"
PROMPT = "the secret recipe is"
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with serve_in_thread(
        tiny_model_dir, api_key=API_KEY, max_request_body_bytes=BODY_LIMIT, log_requests=True
    ) as server:
        yield server


def test_the_openai_client_with_the_key_is_served(guarded: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3)
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3,
        stream=True,
    )
    assert [chunk.choices[0].finish_reason for chunk in stream][-1] == "length"


@pytest.mark.parametrize("key", ["sk-wrong", API_KEY + "x", API_KEY[:-1]])
def test_a_wrong_key_is_401_with_an_openai_error(guarded: LiveServer, key: str) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
    assert raised.value.status_code == 401
    assert raised.value.code == "invalid_api_key"
    assert API_KEY not in raised.value.response.text


def test_probes_and_metrics_are_open_and_everything_else_is_not(guarded: LiveServer) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(guarded.url + path, timeout=10).status_code == 200, path
    for path in ("/v1/models", "/debug/profile", "/openapi.json", "/docs", "/v1/nothing"):
        r = httpx.get(guarded.url + path, timeout=10)
        assert r.status_code == 401, path
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in r.json()["error"]["message"]
    r = httpx.post(f"{guarded.url}/v1/chat/completions", json={}, timeout=10)
    assert r.status_code == 401


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer "])
def test_the_bearer_scheme_is_case_insensitive(guarded: LiveServer, scheme: str) -> None:
    headers = {"Authorization": f"{scheme} {API_KEY}"}
    assert httpx.get(f"{guarded.url}/v1/models", headers=headers, timeout=10).status_code == 200


@pytest.mark.parametrize("authorization", [API_KEY, f"Basic {API_KEY}", "Bearer"])
def test_a_key_without_the_bearer_scheme_says_how_to_send_it(
    guarded: LiveServer, authorization: str
) -> None:
    headers = {"Authorization": authorization}
    r = httpx.get(f"{guarded.url}/v1/models", headers=headers, timeout=10)
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key"
    assert "expected 'Authorization: Bearer <key>'" in error["message"]


def test_a_body_over_the_limit_is_413_declared_or_chunked(guarded: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    body = json.dumps({"model": MODEL_NAME, "prompt": "z" * BODY_LIMIT}).encode()
    url = f"{guarded.url}/v1/completions"
    declared = httpx.post(url, content=body, headers=headers, timeout=30)

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 4096):
            yield body[start : start + 4096]

    chunked = httpx.post(url, content=chunks(), headers=headers, timeout=30)
    for r in (declared, chunked):
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["param"] == "body" and error["code"] == "request_too_large"
        assert str(BODY_LIMIT) in error["message"]
    under = {"model": MODEL_NAME, "prompt": "z" * (BODY_LIMIT // 2), "max_tokens": 1}
    r = httpx.post(url, json=under, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # past the context


def test_request_log_lines_carry_ids_and_counts_not_text(
    guarded: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=API_KEY, max_retries=0)
    with caplog.at_level(logging.INFO):
        completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4)
        stream = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=2, stream=True
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        httpx.get(f"{guarded.url}/v1/models", timeout=10)  # no key: 401
        httpx.get(f"{guarded.url}/health", timeout=10)  # probes are not logged
    lines = [
        json.loads(r.getMessage())
        for r in caplog.records
        if r.name == "kvfleet_engine.server.request_log"
    ]
    assert [(line["path"], line["status"]) for line in lines] == [
        ("/v1/completions", 200),
        ("/v1/completions", 200),
        ("/v1/models", 401),
    ]
    first, second = lines[0], lines[1]
    assert first["request_id"] == completion.id
    assert (first["prompt_tokens"], first["completion_tokens"]) == (len(PROMPT), 4)
    assert first["finish_reasons"] == ["length"] and first["ttft_ms"] > 0
    assert first["duration_ms"] >= first["ttft_ms"]
    assert second["completion_tokens"] == 2
    text = caplog.text
    assert API_KEY not in text and PROMPT not in text
    assert not completion.choices[0].text.strip() or completion.choices[0].text not in text
    assert not streamed.strip() or streamed not in text


def test_bench_serve_loads_a_guarded_server_with_its_key_and_never_records_it(
    guarded: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfleet_engine.bench.serve import main

    argv = ["--url", guarded.url, "--concurrency", "2", "--num-prompts", "2", "--no-progress"]
    argv += ["--random-input-len", "8", "--random-output-len", "2"]
    assert main(argv) == 2  # no key: the model lookup is refused
    assert "401" in capsys.readouterr().err
    out = tmp_path / "bench.json"
    assert main([*argv, "--api-key", API_KEY, "--output", str(out)]) == 0
    assert json.loads(out.read_text())["results"]["completed"] == 2
    assert API_KEY not in out.read_text()
