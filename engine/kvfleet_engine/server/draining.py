"""`kvfleet serve`'s uvicorn server: SIGTERM drains (stop admitting, finish in-flight work up to
--drain-timeout, then exit 0); the engine core dying, or a failed warm-up, ends it with exit
code 1."""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from kvfleet_engine.server.state import ServerState

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains: stop admitting, finish in-flight work, then exit;
    and that the engine core dying ends it with exit code 1."""

    # After the core died: time for the failed requests' error chunks to reach their clients.
    CORE_DEATH_GRACE_S = 0.5

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        state.engine.on_core_died = self._core_died

    def _core_died(self, error: BaseException) -> None:
        log.error("engine core died (%s): exiting with code 1", error)
        self.exit_code = 1
        loop = asyncio.get_running_loop()
        loop.call_later(self.CORE_DEATH_GRACE_S, setattr, self, "should_exit", True)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s): a failed warm-up ends the server, since it would never
        become ready."""
        if self.state.startup_error is not None and not self.should_exit:
            log.error("start-up failed: exiting with code 1")
            self.exit_code = 1
            self.should_exit = True
        return await super().on_tick(counter)

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.state.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        log.info(
            "SIGTERM: draining %d in-flight requests (up to %.0f s)",
            self.state.engine.num_in_flight,
            self.state.settings.drain_timeout_s,
        )
        self.state.draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        engine = self.state.engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.state.settings.drain_timeout_s
        while engine.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            log.warning("drain timeout: aborting %d requests", engine.num_in_flight)
            timeout = self.state.settings.drain_timeout_s
            engine.abort_all(
                f"the server is shutting down and its drain timeout ({timeout:g} s, "
                "--drain-timeout) passed; send the request again, to another replica"
            )
            await asyncio.sleep(0.1)  # let their responses end
        log.info("drained; shutting down")
        self.should_exit = True
