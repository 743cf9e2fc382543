"""A real tiny-model engine core (its own process, as `kvfleet serve` runs it) behind the real
app, served by uvicorn on a free port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serverutil import LiveServer, serve_in_thread


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvfleet_engine.tiny_model import write_tiny_model

    directory = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(directory)
    return directory


@pytest.fixture(scope="session")
def live_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with serve_in_thread(tiny_model_dir) as server:
        yield server
