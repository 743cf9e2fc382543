"""`CoreClient`: the API process's end of the engine core, a process of its own.

It spawns the core (a fresh interpreter: CUDA does not survive fork), waits for its start-up
report (`CoreReady`, or `CoreFailed` with the reason), then sends records and hands every
record that comes back to a callback, read on the event loop itself when the pipe turns
readable (no thread hand-off, no GIL ping-pong per step). End of file on the pipe means the
core exited: the exit callback learns its exit code. Neither side sends a callable; named calls
are `Call` records.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.process import run_engine_core
from kvfleet_engine.core.profile import PhaseProfile
from kvfleet_engine.core.records import (
    CALLS,
    PROTOCOL_VERSION,
    Call,
    CallResult,
    CoreFailed,
    CoreReady,
    FromCore,
    Shutdown,
    ToCore,
    encoder,
    from_core_decoder,
)

log = logging.getLogger(__name__)


class CoreStartError(RuntimeError):
    """The engine core did not come up. `user_error`: the model or a setting is at fault."""

    def __init__(self, message: str, user_error: bool = False) -> None:
        super().__init__(message)
        self.user_error = user_error


class CoreClient:
    """Starts one engine-core process and speaks its protocol. Methods other than `start`
    run on the event loop given to `attach`."""

    def __init__(self, config: EngineConfig, log_level: str = "info") -> None:
        self.config = config
        self.log_level = log_level
        self.ready: CoreReady | None = None  # the core's start-up report
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._encode = encoder().encode
        self._call_ids = itertools.count()
        self._calls: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # set by attach()
        self._closed = False

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> CoreReady:
        """Spawn the core and wait until it has loaded the model (blocking)."""
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe(duplex=True)
        process = context.Process(
            target=run_engine_core,
            args=(self.config, child_conn, self.log_level),
            name="kvfleet-engine-core",
        )
        process.start()
        child_conn.close()  # the core holds the only other end: its exit reads as end of file
        self._process, self._conn = process, conn
        try:
            first = from_core_decoder().decode(conn.recv_bytes())
        except (EOFError, OSError):
            process.join(10)
            raise CoreStartError(
                f"engine core exited during start-up (exit code {process.exitcode})"
            ) from None
        if isinstance(first, CoreFailed):
            process.join(10)
            raise CoreStartError(first.error, first.user_error)
        if not isinstance(first, CoreReady) or first.protocol_version != PROTOCOL_VERSION:
            self.shutdown()
            raise CoreStartError(
                f"engine core speaks another protocol ({first!r}); expected version "
                f"{PROTOCOL_VERSION}"
            )
        self.ready = first
        log.info(
            "engine core (pid %d) ready in %.1f s: %s, %d KV blocks of %d tokens",
            first.pid,
            first.load_s,
            first.device,
            first.num_blocks,
            first.block_size,
        )
        return first

    def attach(
        self,
        loop: asyncio.AbstractEventLoop,
        on_record: Callable[[FromCore], None],
        on_exit: Callable[[int | None], None],
        profile: PhaseProfile,
    ) -> None:
        """Deliver every record from the core to `on_record` on `loop`; `on_exit(exit code)`
        once the core has gone; the reads and decodes count as `profile`'s "records". Call on
        the loop."""
        if self._loop is not None:
            return
        assert self._conn is not None, "start() first"
        self._loop = loop
        conn, decode, clock = self._conn, from_core_decoder().decode, time.perf_counter

        def on_readable() -> None:
            try:
                while True:  # every record that is in the pipe now
                    began = clock()
                    record = decode(conn.recv_bytes())
                    profile.add("records", clock() - began)
                    if isinstance(record, CallResult):
                        self._resolve(record)
                    else:
                        on_record(record)
                    if not conn.poll():
                        return
            except (EOFError, OSError):
                pass
            except msgspec.DecodeError:
                log.exception("undecodable record from the engine core")
            loop.remove_reader(fd)
            loop.create_task(self._reap(on_exit))

        fd = conn.fileno()
        loop.add_reader(fd, on_readable)
        # uvloop's add_reader (libuv's uv_poll_init) turns the descriptor non-blocking. Then a
        # record still arriving raised BlockingIOError in recv_bytes, read above as the core's
        # exit (at 1,024 streams the server declared a live core dead), and a send into a full
        # pipe wrote part of a record or none. Blocking, a read that began on readable waits
        # for the rest of its record (the core writes each whole) and a send waits for room.
        os.set_blocking(fd, True)

    async def _reap(self, on_exit: Callable[[int | None], None]) -> None:
        """The core closed its end: wait for its exit code (off the loop), then report."""
        assert self._process is not None
        await asyncio.get_running_loop().run_in_executor(None, self._process.join, 5)
        on_exit(self._process.exitcode)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to exit, wait for it, kill it if it does not; idempotent."""
        process = self._process
        if process is None or self._closed:
            return
        self._closed = True
        if process.is_alive():
            self.send(Shutdown())
            process.join(timeout_s)
        if process.is_alive():
            log.warning("engine core did not exit in %.0f s; killing it", timeout_s)
            process.kill()
            process.join(5)
        if self._conn is not None:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.remove_reader(self._conn.fileno())
            self._conn.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode if self._process is not None else None

    # --- records -----------------------------------------------------------------------------

    def send(self, record: ToCore) -> None:
        """Send one record; a core that has gone is reported by the reader, not here."""
        if self._conn is None:
            return
        try:
            self._conn.send_bytes(self._encode(record))
        except OSError:
            pass

    async def call(self, name: str, **args: Any) -> Any:
        """Run the core's named call `name` between steps; its result, converted."""
        if name not in CALLS:
            raise ValueError(f"call must be one of {sorted(CALLS)}, got {name!r}")
        call_id = next(self._call_ids)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (name, done)
        self.send(Call(call_id, name, args))
        return await done

    def fail_calls(self, error: BaseException) -> None:
        for _, done in self._calls.values():
            if not done.done():
                done.set_exception(error)
        self._calls.clear()

    def _resolve(self, result: CallResult) -> None:
        name, done = self._calls.pop(result.call_id, ("", None))
        if done is None or done.done():
            return
        if result.error is not None:
            done.set_exception(RuntimeError(f"engine core call {name} failed: {result.error}"))
            return
        result_type = CALLS[name]
        value = None if result_type is None else msgspec.convert(result.result, result_type)
        done.set_result(value)
