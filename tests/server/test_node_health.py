"""The compute-only node's /health and /ready server (`kvfleet serve --node-rank R`, R > 0): a
client that stalls in its request is disconnected after REQUEST_TIMEOUT_S instead of holding one
of the server's threads, while probes on other connections are answered."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from kvfleet_engine.parallel import node

TIMEOUT_S = 0.5


@pytest.fixture
def health_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(node, "REQUEST_TIMEOUT_S", TIMEOUT_S)
    server = ThreadingHTTPServer(("127.0.0.1", 0), node._handler(node.NodeHealth(ranks=1)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_stalled_request_is_disconnected_while_probes_are_answered(health_server: int) -> None:
    stalled = socket.create_connection(("127.0.0.1", health_server))
    stalled.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
    opened = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{health_server}/health", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    stalled.settimeout(TIMEOUT_S + 5)
    assert stalled.recv(1024) == b""  # closed by the server, nothing sent
    assert time.monotonic() - opened < TIMEOUT_S + 2.0
    stalled.close()
