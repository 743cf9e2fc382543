"""`kvfleet serve` as a real process: 429 under overload, idle connections kept for
--keep-alive-timeout, a request head that stalls closed after --header-timeout (both protocols'
details: test_header_timeout.py), a body that stalls answered 408 after --body-timeout, and a
SIGTERM drain that loses nothing (sent to the whole
process group, engine core included, as a shell's `kill %1` sends it)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serverutil import MODEL_NAME, free_port, metric, wait_ready

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 4.0  # above the slow-body test's pause, twice HEADER_TIMEOUT_S
SLACK_S = 2.0  # a loaded CI machine's scheduling delay, on top of the timeout


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("wb")
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(tiny_model_dir)]
    command += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--device", "cpu", "--kv-cache-blocks", "256", "--max-model-len", "512"]
    command += ["--max-num-seqs", "8", "--max-num-batched-tokens", "512"]
    command += ["--max-queued-requests", "1", "--drain-timeout", "60", "--keep-alive-timeout", "8"]
    command += ["--ttft-slo-ms", "60000", "--tpot-slo-ms", "1000"]  # SLA mode, loose targets
    command += ["--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S)]
    # a group of its own: the drain test signals the whole group, as a shell's `kill %1` does
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_overload_is_refused_with_429_and_retry_after(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, _ = served
    body = {"model": MODEL_NAME, "prompt": "load", "max_tokens": 24, "ignore_eos": True}

    def post(_: int) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(post, range(12)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert 200 in statuses and 429 in statuses, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "--max-queued-requests 1" in refused.json()["error"]["message"]
    text = httpx.get(f"{url}/metrics", timeout=10).text
    rejected = metric(
        text, 'kvfleet_requests_rejected_total{model_name="kvfleet-tiny",reason="queue_full"}'
    )
    assert rejected == statuses.count(429)


def test_an_idle_connection_stays_open_for_the_keep_alive_timeout_then_closes(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        assert first.status == 200
        sock = conn.sock
        time.sleep(6)  # idle past uvicorn's default 5 s, within --keep-alive-timeout 8
        conn.request("GET", "/health")
        second = conn.getresponse()
        second.read()
        assert second.status == 200 and conn.sock is sock  # the same connection
        time.sleep(10)  # idle past it: the server has closed the connection
        assert sock.recv(1) == b""
    finally:
        conn.close()


def test_a_request_head_that_stalls_is_closed_after_the_header_timeout(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HEADER_TIMEOUT_S + SLACK_S) as sock:
        opened = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: no end
        health = httpx.get(f"{url}/health", timeout=10)  # others are served meanwhile
        assert health.status_code == 200
        assert sock.recv(1024) == b""  # closed by the server, nothing sent
        waited = time.monotonic() - opened
    assert HEADER_TIMEOUT_S * 0.9 <= waited <= HEADER_TIMEOUT_S + SLACK_S


def test_a_request_body_slower_than_the_header_timeout_is_not_cut_off(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "no-such-model", "prompt": "slow"}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        time.sleep(HEADER_TIMEOUT_S * 2)
        sock.sendall(body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        error = json.loads(response.read())["error"]
    # the whole body arrived: the model it names is unknown
    assert response.status == 404 and "'no-such-model' does not exist" in error["message"]


def _post_head(body_length: int | None) -> bytes:
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if body_length is None:
        head += "Transfer-Encoding: chunked\r\n"
    else:
        head += f"Content-Length: {body_length}\r\n"
    return (head + "\r\n").encode()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_request_body_that_stalls_gets_408_after_the_body_timeout_and_is_closed(
    served: tuple[str, subprocess.Popen[bytes]], framing: str
) -> None:
    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL_NAME, "prompt": "stalls"}).encode()
    sent = body[:10]
    with socket.create_connection((host, int(port)), timeout=BODY_TIMEOUT_S + SLACK_S) as sock:
        if framing == "chunked":
            sock.sendall(_post_head(None) + b"%x\r\n%s\r\n" % (len(sent), sent))
        else:
            sock.sendall(_post_head(len(body)) + sent)
        stalled = time.monotonic()
        response = http.client.HTTPResponse(sock)
        response.begin()
        error = json.loads(response.read())["error"]
        waited = time.monotonic() - stalled
        assert sock.recv(1) == b""  # and the connection is closed
    assert response.status == 408 and error["code"] == "request_timeout"
    assert error["param"] == "body" and "--body-timeout" in error["message"]
    assert f"after {len(sent)}" in error["message"]
    assert BODY_TIMEOUT_S * 0.9 <= waited <= BODY_TIMEOUT_S + SLACK_S


def test_a_body_trickling_in_for_longer_than_the_body_timeout_is_served(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """The timeout bounds the wait for the next bytes, not the whole body: a slow link is
    served."""
    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "no-such-model", "prompt": "trickles"}).encode()
    pieces = [body[:8], body[8:16], body[16:]]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(_post_head(len(body)))
        started = time.monotonic()
        for piece in pieces:
            time.sleep(BODY_TIMEOUT_S / 2)
            sock.sendall(piece)
        response = http.client.HTTPResponse(sock)
        response.begin()
        error = json.loads(response.read())["error"]
    assert time.monotonic() - started > BODY_TIMEOUT_S
    # the whole body arrived: the model it names is unknown
    assert response.status == 404 and "'no-such-model' does not exist" in error["message"]


def test_sigterm_to_the_process_group_drains_in_flight_requests_then_exits_0(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = served
    body = {
        "model": MODEL_NAME,
        "prompt": "drain",
        # Long enough that the drain outlasts the checks below on a loaded CI machine (at 150 a
        # full suite run once finished the drain, and the server, before the late request).
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    results: list[dict[str, object]] = []
    started = [threading.Event() for _ in range(3)]

    def stream(k: int) -> None:
        finish, usage = None, None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                started[k].set()
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finish = chunk["choices"][0]["finish_reason"]
                usage = chunk.get("usage") or usage
        results.append({"finish": finish, "usage": usage})

    workers = []
    for k in range(3):  # one at a time: the queue bound is 1
        workers.append(threading.Thread(target=stream, args=(k,)))
        workers[-1].start()
        assert started[k].wait(60)
    os.killpg(proc.pid, signal.SIGTERM)  # the engine core too, were it in the group
    ready = httpx.get(f"{url}/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    late = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=10)
    assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
    for worker in workers:
        worker.join(120)
    assert len(results) == 3
    for result in results:
        assert result["finish"] == "length"
        usage = result["usage"]
        assert isinstance(usage, dict) and usage["completion_tokens"] == body["max_tokens"]
        assert usage["prompt_tokens"] == len(b"drain")  # the byte tokenizer adds no BOS
    assert proc.wait(timeout=60) == 0
