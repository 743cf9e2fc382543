"""Fixtures: fake engines (small local HTTP servers) and a router in front of them, served as
`kvfleet router` serves it (its runner, on a free port), all in the test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fake_engine import MODEL, FakeEngine
from router_fixtures import RunningRouter, StartEngines, StartRouter

from kvfleet_router.app import Router
from kvfleet_router.settings import RouterSettings


@pytest.fixture
async def start_engines() -> AsyncIterator[StartEngines]:
    started: list[FakeEngine] = []

    async def start(count: int) -> list[FakeEngine]:
        engines = [await FakeEngine().start() for _ in range(count)]
        started.extend(engines)
        return engines

    yield start
    for engine in started:
        await engine.stop()


@pytest.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    running: list[RunningRouter] = []

    async def start(backends: list[str], wait: bool = True, **overrides: Any) -> RunningRouter:
        settings = replace(
            RouterSettings(backends=tuple(backends), served_model_names=(MODEL,)), **overrides
        )
        router = Router(settings)
        runner = router.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        result = RunningRouter(router, runner, port, aiohttp.ClientSession())
        running.append(result)
        if wait:
            await result.wait_available(len(backends))
        return result

    yield start
    for item in running:
        await item.http.close()
        await item.runner.cleanup()
