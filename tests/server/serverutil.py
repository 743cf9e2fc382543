"""Helpers shared by the server tests (a module, so tests can import it)."""

from __future__ import annotations

import socket
import time

import httpx

MODEL_NAME = "kvfleet-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(base_url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url} not ready after {timeout_s} s")


def metric(text: str, line_start: str) -> float:
    """The value of the first exposition line starting with `line_start`."""
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric line starts with {line_start!r}")


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text
