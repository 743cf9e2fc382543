"""`kvfleet bench serve --dataset chat`: the built-in questions, sent as chat messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet_engine.bench.chat import QUESTIONS
from kvfleet_engine.bench.serve import main
from kvfleet_engine.bench.serve_workload import chat_requests


def test_chat_dataset_asks_the_questions_in_turn() -> None:
    requests = chat_requests(len(QUESTIONS) + 2, 64)
    assert [r.prompt for r in requests] == [*QUESTIONS, QUESTIONS[0], QUESTIONS[1]]
    assert {(r.max_tokens, r.num_prompt_tokens) for r in requests} == {(64, 0)}


def test_chat_dataset_refuses_the_completions_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", "http://x", "--concurrency", "1", "--dataset", "chat"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--endpoint", "completions"])
    assert exc.value.code == 2
    assert "--dataset chat sends messages" in capsys.readouterr().err


def test_bench_serve_chat_against_the_server(live_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["--url", live_server.url, "--concurrency", "2", "--num-prompts", "4"]
    # 24 tokens a stream: a loaded server may send a stream's tokens in fewer chunks than
    # tokens, and with 5 it sent every stream as one chunk once (no gap between chunks: ITL nan)
    argv += ["--dataset", "chat", "--chat-output-len", "24", "--no-progress", "--output", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    results = record["results"]
    assert record["config"]["endpoint"] == "chat"
    assert results["completed"] == 4 and results["failed"] == 0
    assert results["total_output_tokens"] == 96  # EOS ignored: 24 tokens each, from usage
    assert results["total_input_tokens"] > 4 * 5  # the chat template's tokens around each question
    assert results["ttft_ms"]["p50"] > 0 and results["itl_ms"]["p99"] > 0
