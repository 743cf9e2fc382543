"""The engine core as a process of its own: what clients see when it dies, and that neither
process outlives the other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serverutil import MODEL_NAME, free_port, wait_ready

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))  # the process helpers
from kvcluster.procs import ENGINE_CORE, child_running, children, kill_tree, wait_gone

pytestmark = pytest.mark.slow


@pytest.fixture
def serve(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(tiny_model_dir)]
    command += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--device", "cpu", "--kv-cache-blocks", "128", "--max-model-len", "512"]
    command += ["--max-num-seqs", "4", "--max-num-batched-tokens", "256"]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        yield url, proc
    finally:
        kill_tree(proc)
        log.close()


def test_core_death_fails_requests_turns_health_503_and_exits_non_zero(
    serve: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = serve
    kids = children(proc.pid)
    core = child_running(proc.pid, ENGINE_CORE)
    body = {"model": MODEL_NAME, "prompt": "die", "max_tokens": 400, "ignore_eos": True}
    events = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        lines = r.iter_lines()
        for line in lines:  # tokens are flowing: the request is running in the core
            if line.startswith("data: {"):
                events.append(line)
                break
        os.kill(core, signal.SIGKILL)
        health = None
        for line in lines:
            if not line:
                continue
            events.append(line)
            if health is None and "error" in line:
                health = httpx.get(f"{url}/health", timeout=5)
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable"
    assert "engine core process exited" in error["message"]
    assert health is not None and health.status_code == 503
    assert health.json()["status"] == "unhealthy"
    assert proc.wait(timeout=30) == 1
    assert wait_gone(kids, 30) == []  # no orphans: the resource tracker went too


def test_sigkill_of_the_api_process_ends_the_core(
    serve: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = serve
    kids = children(proc.pid)
    core = child_running(proc.pid, ENGINE_CORE)
    body = {"model": MODEL_NAME, "prompt": "orphan", "max_tokens": 400, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():  # the core is busy stepping when its parent dies
            if line.startswith("data: {"):
                break
        proc.kill()
        proc.wait()
    assert wait_gone([core], 30) == [], "engine core outlived its API process"
    assert wait_gone(kids, 30) == []
