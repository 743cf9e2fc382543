"""Start-up: a short context still warms up and serves; a model directory without a tokenizer
and a failed warm-up end `kvfleet serve` with one line saying why."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from serverutil import MODEL_NAME, free_port, serve_in_thread

from kvfleet_engine.metrics import EngineInfo, EngineMetrics
from kvfleet_engine.server.admission import AdmissionConfig
from kvfleet_engine.server.app import build_app
from kvfleet_engine.server.draining import DrainingServer
from kvfleet_engine.server.state import ServerSettings, ServerState


def test_a_context_of_16_tokens_warms_up_and_serves(tiny_model_dir: Path) -> None:
    with serve_in_thread(tiny_model_dir, max_model_len=16) as server:  # waits for /ready
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4


def test_a_model_directory_without_a_tokenizer_is_one_line_naming_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(model)]
    command += ["--device", "cpu", "--kv-cache-blocks", "256", "--port", str(free_port())]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"kvfleet serve: --model {model}: no tokenizer files there" in proc.stderr
    assert "Traceback" not in proc.stderr


class EngineWhoseWarmUpFails:
    """What the app needs of an engine, with a self-benchmark that fails as a core's would."""

    tokenizer = None
    error = None
    on_core_died = None
    is_alive = True

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    async def measure_capacity(self, *args: Any) -> None:
        raise RuntimeError("ValueError: prompt is too long: 16 tokens, but max_model_len is 16")


def test_a_failed_warm_up_ends_the_server_with_exit_code_1(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = ServerSettings(
        served_model_name=MODEL_NAME,
        max_model_len=16,
        vocab_size=256,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        admission=AdmissionConfig(None, None, None, None),
        drain_timeout_s=1.0,
    )
    metrics = EngineMetrics(EngineInfo(MODEL_NAME, "test", "none", 1))
    state = ServerState(settings, EngineWhoseWarmUpFails(), metrics)  # type: ignore[arg-type]
    config = uvicorn.Config(build_app(state), host="127.0.0.1", port=free_port())
    server = DrainingServer(config, state)
    thread = threading.Thread(target=server.run, daemon=True)
    with caplog.at_level(logging.ERROR):
        thread.start()
        thread.join(60)
    stuck = thread.is_alive()
    server.should_exit = True
    assert not stuck, "the server sits in 'starting' after its warm-up failed"
    assert server.exit_code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(
        "start-up self-benchmark failed: ValueError: prompt is too long" in e for e in errors
    )


def test_requests_past_the_drain_timeout_end_saying_why(tiny_model_dir: Path) -> None:
    """SIGTERM with a stream in flight that outlasts --drain-timeout: the stream ends with an
    error chunk that names the drain timeout (it said only "request ... was aborted")."""
    import json
    import signal

    with serve_in_thread(
        tiny_model_dir, max_model_len=2048, draining=True, drain_timeout_s=0.3
    ) as live:
        body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}  # fmt: skip
        errors = []
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {") and live.server is not None:
                    live.server.handle_exit(signal.SIGTERM, None)  # type: ignore[attr-defined]
                    live.server = None  # once
                if line.startswith("data: {") and '"error"' in line:
                    errors.append(json.loads(line.removeprefix("data: "))["error"]["message"])
        assert len(errors) == 1, errors
        assert "was aborted: the server is shutting down" in errors[0]
        assert "drain timeout (0.3 s, --drain-timeout)" in errors[0]
