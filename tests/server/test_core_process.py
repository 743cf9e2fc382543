"""The engine core as a process of its own: what clients see when it dies, and that neither
process outlives the other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serverutil import MODEL_NAME, free_port, wait_ready

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _is_running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _engine_core_pid(api_pid: int) -> int:
    for pid in _children(api_pid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no engine-core child of {api_pid}")


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [pid for pid in pids if _is_running(pid)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


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
        children = _children(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _wait_gone(children, 30):
            os.kill(pid, signal.SIGKILL)
        log.close()


def test_core_death_fails_requests_turns_health_503_and_exits_non_zero(
    serve: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = serve
    children = _children(proc.pid)
    core = _engine_core_pid(proc.pid)
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
    assert _wait_gone(children, 30) == []  # no orphans: the resource tracker went too


def test_sigkill_of_the_api_process_ends_the_core(
    serve: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = serve
    children = _children(proc.pid)
    core = _engine_core_pid(proc.pid)
    body = {"model": MODEL_NAME, "prompt": "orphan", "max_tokens": 400, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():  # the core is busy stepping when its parent dies
            if line.startswith("data: {"):
                break
        proc.kill()
        proc.wait()
    assert _wait_gone([core], 30) == [], "engine core outlived its API process"
    assert _wait_gone(children, 30) == []
