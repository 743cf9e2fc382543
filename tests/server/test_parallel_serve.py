"""`kvfleet serve --tensor-parallel-size 2 --device cpu`: two ranks (the engine core and one
worker it starts, gloo) serve a chat request; the metrics report the world size; a worker
killed turns /health 503 with the reason and the server exits non-zero within the bound.
The same over two "nodes" on 127.0.0.1 (`--nnodes 2`, one rank each): the compute-only node
answers /health and /ready only, the leader serves, and killing the compute node's process
ends its rank too, so the leader reports it and exits. Two pipeline stages
(`--pipeline-parallel-size 2`) answer concurrent completions with one rank's text."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
    return [pid for core in _children(api_pid) for pid in _spawned(core)]


def _spawned(pid: int) -> list[int]:
    """`pid`'s children that run the multiprocessing spawn entry point (rank processes)."""
    found = []
    for child in _children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def _serve_command(model: Path, port: int, *flags: str) -> list[str]:
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(model)]
    command += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--device", "cpu", "--kv-cache-blocks", "64", "--max-model-len", "256"]
    return command + list(flags)


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
    command = _serve_command(
        tiny_model_dir, port, "--tensor-parallel-size", "2", "--master-port", str(master_port)
    )
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


CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}


def _unhealthy_until_exit(url: str, proc: subprocess.Popen[bytes], since: float) -> dict | None:
    """Poll /health until `proc` exits (or the bound passes); its last 503 body."""
    health = None
    while proc.poll() is None and time.monotonic() - since < EXIT_BOUND_S:
        try:
            answer = httpx.get(f"{url}/health", timeout=1)
        except httpx.HTTPError:
            continue
        if answer.status_code == 503:
            health = answer.json()
        time.sleep(0.02)
    return health


def test_tp2_serves_and_a_dead_rank_ends_the_server(
    serve_tp2: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = serve_tp2
    response = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert metric(scrape(url), "kvfleet_parallel_world_size") == 2
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200

    (worker,) = _worker_pids(proc.pid)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    health = _unhealthy_until_exit(url, proc, killed)
    assert health is not None, "never saw /health 503"
    assert health["status"] == "unhealthy"
    assert f"rank 1 (pid {worker}) exited with code -9" in health["reason"]
    assert proc.wait(timeout=EXIT_BOUND_S) == 1
    assert time.monotonic() - killed < EXIT_BOUND_S


@pytest.fixture
def two_nodes(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes], str, subprocess.Popen[bytes]]]:
    """Node 1 (compute only) started first, then the leader: TP 2 over two hosts."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    master_port = _free_port_pair()
    group = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(master_port)]
    group += ["--master-addr", "127.0.0.1", "--max-num-seqs", "4"]
    procs, logs = [], []
    urls = []
    for node_rank in (1, 0):
        port = free_port()
        log = (tmp_path / f"node{node_rank}.log").open("wb")
        command = _serve_command(tiny_model_dir, port, *group, "--node-rank", str(node_rank))
        procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
        logs.append(log)
        urls.append(f"http://127.0.0.1:{port}")
    (worker_url, leader_url), (worker, leader) = urls, procs
    try:
        wait_ready(leader_url, timeout_s=480)
        yield leader_url, leader, worker_url, worker
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def test_two_nodes_serve_through_the_leader_and_a_dead_node_ends_it(
    two_nodes: tuple[str, subprocess.Popen[bytes], str, subprocess.Popen[bytes]],
) -> None:
    leader_url, leader, worker_url, worker = two_nodes
    # The compute-only node: joined and loaded, and nothing but /health and /ready.
    assert httpx.get(f"{worker_url}/ready", timeout=5).json() == {"status": "ready"}
    assert httpx.get(f"{worker_url}/health", timeout=5).json() == {"status": "ok"}
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(f"{worker_url}{path}", timeout=5).status_code == 404
    assert httpx.post(f"{worker_url}/v1/chat/completions", json=CHAT, timeout=5).status_code == 404

    response = httpx.post(f"{leader_url}/v1/chat/completions", json=CHAT, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert metric(scrape(leader_url), "kvfleet_parallel_world_size") == 2

    # SIGKILL the compute node's `kvfleet serve`: its rank notices its launcher gone and exits,
    # the leader sees the rank's step channel close.
    (rank,) = _spawned(worker.pid)
    os.kill(worker.pid, signal.SIGKILL)
    killed = time.monotonic()
    health = _unhealthy_until_exit(leader_url, leader, killed)
    assert health is not None, "never saw the leader's /health 503"
    assert health["status"] == "unhealthy"
    assert f"rank 1 (pid {rank}) disconnected" in health["reason"]
    assert leader.wait(timeout=EXIT_BOUND_S) == 1
    assert time.monotonic() - killed < EXIT_BOUND_S
    assert not Path(f"/proc/{rank}").exists() or b"zombie" in _state(rank)


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"


def test_a_node_that_cannot_reach_the_leader_exits_with_the_reason(
    tiny_model_dir: Path,
) -> None:
    master_port = _free_port_pair()  # nobody listens there
    command = _serve_command(tiny_model_dir, free_port(), "--tensor-parallel-size", "2")
    command += ["--nnodes", "2", "--node-rank", "1", "--master-port", str(master_port)]
    command += ["--parallel-join-timeout", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert (
        f"node 1 exits with code 1: rank 1: could not reach the leader's step channel at "
        f"127.0.0.1:{master_port + 1} within 2 s" in done.stderr
    ), done.stderr[-2000:]


def test_pp2_serves_completions_with_one_rank_s_text(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`--pipeline-parallel-size 2`: two stages (the engine core and one worker) answer three
    concurrent completions (micro-batches in flight) with the text one rank gives."""
    from kvfleet_engine import LLM, SamplingParams

    port, master_port = free_port(), _free_port_pair()
    command = _serve_command(
        tiny_model_dir, port, "--pipeline-parallel-size", "2", "--master-port", str(master_port)
    )
    prompts = ["hello", "a longer prompt than the first", "third"]
    reference = LLM(str(tiny_model_dir), device="cpu", max_model_len=256, kv_cache_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [out.outputs[0].text for out in reference.generate(prompts, params, use_tqdm=False)]
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "serve.log").open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, timeout_s=480)

            def complete(prompt: str) -> httpx.Response:
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8}
                body |= {"temperature": 0, "ignore_eos": True}
                return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

            with ThreadPoolExecutor(len(prompts)) as pool:
                responses = list(pool.map(complete, prompts))
            assert [r.status_code for r in responses] == [200] * 3, responses[0].text
            assert [r.json()["choices"][0]["text"] for r in responses] == want
            assert metric(scrape(url), "kvfleet_parallel_world_size") == 2
        finally:
            proc.kill()
            proc.wait()
