"""Processes dying under a stream: the API process SIGKILLed (the client gets a clean connection
error, the core goes too, a restarted server is ready and serving), then the engine core killed
(the stream ends with an error event, /health turns 503, `kvfleet serve` exits 1)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from chaosutil import AUTH, MODEL_NAME, TALLY, Serve, free_port, read_stream, wait_gone

pytestmark = pytest.mark.slow

ARGS = ("--kv-cache-blocks", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "256")
LONG = {"model": MODEL_NAME, "prompt": "fault", "max_tokens": 400, "ignore_eos": True}
STREAM = {**LONG, "stream": True}


def test_sigkill_then_restart_then_the_core_killed(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    first = Serve(tiny_model_dir, tmp_path / "first.log", port, *ARGS)
    second: Serve | None = None
    try:
        first.wait_ready()
        core = first.core_pid
        url = f"{first.url}/v1/completions"
        with httpx.stream("POST", url, json=STREAM, headers=AUTH, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            first.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(httpx.TransportError) as raised:
                for _ in lines:
                    pass
        TALLY.add("sigkill", type(raised.value).__name__)
        assert wait_gone([core], 30) == [], "the engine core outlived its API process"
        core_gone_s = time.monotonic() - killed

        second = Serve(tiny_model_dir, tmp_path / "second.log", port, *ARGS)
        ready_s = second.wait_ready()
        served = httpx.post(url, json={**LONG, "max_tokens": 4}, headers=AUTH, timeout=60)
        TALLY.add("sigkill", f"restart {served.status_code}")
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        TALLY.note(
            "SIGKILL",
            f"client: {type(raised.value).__name__}; core gone {core_gone_s:.1f} s later; "
            f"restarted server ready in {ready_s:.1f} s and serving",
        )

        with httpx.stream("POST", url, json=STREAM, headers=AUTH, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(second.core_pid, signal.SIGKILL)
            core_killed = time.monotonic()
            result = read_stream(_Lines(lines))
        assert result.error is not None and result.error["type"] == "service_unavailable"
        health = httpx.get(f"{second.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert second.proc.wait(timeout=30) == 1
        exited_s = time.monotonic() - core_killed
        TALLY.add("core_killed", f"stream error {result.error['type']}")
        TALLY.add("core_killed", f"health {health.status_code}")
        TALLY.add("core_killed", f"exit {second.proc.returncode}")
        TALLY.note(
            "engine core killed",
            f"stream ended with an error event, /health 503, exit 1 after {exited_s:.1f} s",
        )
    finally:
        first.stop()
        if second is not None:
            second.stop()


class _Lines:
    def __init__(self, lines: object) -> None:
        self._lines = lines

    def iter_lines(self) -> object:
        return self._lines
