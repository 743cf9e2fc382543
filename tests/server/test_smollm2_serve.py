"""`kvfleet serve` with no --model serves the embedded SmolLM2-135M-Instruct; the official
`openai` client gets real answers from it, streamed or not."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serverutil import free_port, wait_ready

from kvfleet_engine.model_store import DEFAULT_MODEL, fetch

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    fetch(DEFAULT_MODEL)  # cached by `make venv`; the server would fetch it itself otherwise
    port = free_port()
    log_path = Path(tmp_path_factory.mktemp("serve")) / "serve.log"
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--device", "cpu", "--max-num-seqs", "8"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, timeout_s=300)
        yield f"{base}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_models_lists_the_embedded_model(url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused")
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL.served_name]


def test_the_capital_of_france_is_paris(url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused")
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL.served_name, messages=QUESTION, temperature=0, max_tokens=32
    )
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=DEFAULT_MODEL.served_name, messages=QUESTION, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == answer.choices[0].message.content
