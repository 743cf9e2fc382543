"""A real tiny-model engine core (its own process, as `kvfleet serve` runs it) behind the real
app, served by uvicorn on a free port."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from serverutil import MODEL_NAME, free_port, wait_ready


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvfleet_engine.tiny_model import write_tiny_model

    directory = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(directory)
    return directory


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    state: object  # kvfleet_engine.server.state.ServerState


@pytest.fixture(scope="session")
def live_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    from kvfleet_engine.async_engine import AsyncEngine
    from kvfleet_engine.client.core_client import CoreClient
    from kvfleet_engine.config import EngineConfig
    from kvfleet_engine.metrics import EngineInfo, EngineMetrics
    from kvfleet_engine.server.admission import AdmissionConfig
    from kvfleet_engine.server.app import build_app
    from kvfleet_engine.server.state import ServerSettings, ServerState
    from kvfleet_engine.tokenizer import load_tokenizer

    config = EngineConfig.create(
        str(tiny_model_dir),
        device="cpu",
        kv_cache_blocks=256,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        max_model_len=512,
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
        drain_timeout_s=5.0,
    )
    engine = AsyncEngine(client, load_tokenizer(config.model), metrics)
    state = ServerState(settings, engine, metrics)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    yield LiveServer(url, state)
    server.should_exit = True
    thread.join(30)
    client.shutdown()
