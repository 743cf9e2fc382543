"""`kvfleet serve --tensor-parallel-size 2 --device cpu`: two ranks (the engine core and one
worker it starts, gloo) serve a chat request; the metrics report the world size; a worker
killed turns /health 503 with the reason and the server exits non-zero within the bound."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serverutil import MODEL_NAME, free_port, metric, scrape, wait_ready

pytestmark = pytest.mark.slow

EXIT_BOUND_S = 30


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _worker_pids(api_pid: int) -> list[int]:
    """The rank processes: children of the engine core (itself the API process's child) that
    run the spawn entry point."""
    found = []
    for core in _children(api_pid):
        for pid in _children(core):
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
    return found


def _free_port_pair() -> int:
    """A port p with p + 1 free too (torch.distributed, the step channel)."""
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.fixture
def serve_tp2(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port, master_port = free_port(), _free_port_pair()
    log = (tmp_path / "serve.log").open("wb")
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(tiny_model_dir)]
    command += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--device", "cpu", "--kv-cache-blocks", "64", "--max-model-len", "256"]
    command += ["--tensor-parallel-size", "2", "--master-port", str(master_port)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=480)  # two ranks start on a shared 2-core machine
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_tp2_serves_and_a_dead_rank_ends_the_server(
    serve_tp2: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = serve_tp2
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert metric(scrape(url), "kvfleet_parallel_world_size") == 2
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200

    (worker,) = _worker_pids(proc.pid)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    health = None
    while proc.poll() is None and time.monotonic() - killed < EXIT_BOUND_S:
        try:
            answer = httpx.get(f"{url}/health", timeout=1)
        except httpx.HTTPError:
            continue
        if answer.status_code == 503:
            health = answer.json()
        time.sleep(0.02)
    assert health is not None, "never saw /health 503"
    assert health["status"] == "unhealthy"
    assert f"rank 1 (pid {worker}) exited with code -9" in health["reason"]
    assert proc.wait(timeout=EXIT_BOUND_S) == 1
    assert time.monotonic() - killed < EXIT_BOUND_S
