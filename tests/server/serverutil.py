"""Helpers shared by the server tests (a module, so tests can import it)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

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


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    state: object  # kvfleet_engine.server.state.ServerState
    server: object = None  # the uvicorn.Server (a DrainingServer with draining=True)


@contextlib.contextmanager
def serve_in_thread(
    tiny_model_dir: Path, *, max_model_len: int = 512, draining: bool = False, **overrides: object
) -> Iterator[LiveServer]:
    """The tiny model's engine core and the app in a uvicorn thread, ready; `overrides` set
    ServerSettings fields (api_key, max_request_body_bytes, log_requests, drain_timeout_s, ...);
    `draining`: served by `kvfleet serve`'s DrainingServer (SIGTERM through handle_exit)."""
    from kvfleet_engine.async_engine import AsyncEngine
    from kvfleet_engine.client.core_client import CoreClient
    from kvfleet_engine.config import EngineConfig
    from kvfleet_engine.metrics import EngineInfo, EngineMetrics
    from kvfleet_engine.server.admission import AdmissionConfig
    from kvfleet_engine.server.app import build_app
    from kvfleet_engine.server.cli import DEFAULT_HEADER_TIMEOUT_S
    from kvfleet_engine.server.draining import DrainingServer
    from kvfleet_engine.server.header_timeout import http_protocol
    from kvfleet_engine.server.state import ServerSettings, ServerState
    from kvfleet_engine.tokenizer import load_tokenizer

    config = EngineConfig.create(
        str(tiny_model_dir),
        device="cpu",
        kv_cache_blocks=256,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        max_model_len=max_model_len,
    )
    client = CoreClient(config, log_level="warning")
    client.start()
    metrics = EngineMetrics(EngineInfo(MODEL_NAME, "test", "none", 1))
    settings = ServerSettings(
        served_model_name=MODEL_NAME,
        max_model_len=config.model.max_model_len,
        vocab_size=config.model.vocab_size,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs,
        admission=AdmissionConfig(None, None, None, None),
        **{"drain_timeout_s": 5.0, **overrides},  # type: ignore[arg-type]
    )
    engine = AsyncEngine(client, load_tokenizer(config.model), metrics)
    state = ServerState(settings, engine, metrics)
    port = free_port()
    config_ = uvicorn.Config(
        build_app(state),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=http_protocol(DEFAULT_HEADER_TIMEOUT_S),  # `kvfleet serve`'s protocol
    )
    server = DrainingServer(config_, state) if draining else uvicorn.Server(config_)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    yield LiveServer(url, state, server)
    server.should_exit = True
    thread.join(30)
    client.shutdown()
