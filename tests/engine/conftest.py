from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from engine_checkpoints import Checkpoints
from parallel_cases import SETTINGS as PARALLEL_SETTINGS
from parallel_cases import free_port_pair
from quant_fixtures import quantized_checkpoints  # noqa: F401 (session fixture)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def make_llm(checkpoints: Checkpoints) -> Callable[..., Any]:
    from kvfleet_engine import LLM

    def make(name: str, **kwargs: Any) -> Any:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("max_model_len", 512)
        return LLM(str(checkpoints.path(name)), **kwargs)

    return make


@pytest.fixture(scope="module")
def world(make_llm: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """make(name, tp, pp=1) -> an LLM over tp x pp ranks with the parallel tests' settings. One
    world at a time: the driver (rank 0) is this process, so making one shuts the previous one
    down."""
    made: list[Any] = []

    def make(name: str, tp: int, pp: int = 1, **kwargs: Any) -> Any:
        while made:
            made.pop().engine.model_runner.shutdown()
        llm = make_llm(
            name,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            master_port=free_port_pair(),
            **{**PARALLEL_SETTINGS, **kwargs},
        )
        made.append(llm)
        return llm

    yield make
    while made:
        made.pop().engine.model_runner.shutdown()
