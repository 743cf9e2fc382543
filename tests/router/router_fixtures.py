"""The types of the router tests' fixtures (conftest.py): tests import them from here, not from
`conftest`, which names a different module in each test directory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from fake_engine import FakeEngine

from kvfleet_router.app import Router


@dataclass
class RunningRouter:
    router: Router
    runner: web.AppRunner
    port: int
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_available(self, count: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.router.pool.available()) < count:
            assert time.monotonic() < deadline, f"{count} replicas never became available"
            await asyncio.sleep(0.02)

    async def post(self, path: str, data: bytes, **kwargs: Any) -> aiohttp.ClientResponse:
        return await self.http.post(self.url + path, data=data, **kwargs)


StartEngines = Callable[[int], Awaitable[list[FakeEngine]]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
