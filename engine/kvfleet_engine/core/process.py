"""The engine-core process: loads the model, then runs the step loop for one API process.

    API process                           engine-core process
    -----------                           -------------------
    AddRequest / AbortRequests / Call --> input thread -> command queue
                                          step loop: apply commands, step, send
    reader thread <-------------------- StepOutputs / CallResult

The loop applies every queued command between steps, then steps while any request is
unfinished; idle, it blocks on the command queue. The core's life follows its API process:
end of file on the pipe (the API process exited, however it exited, SIGKILL included) or a
`Shutdown` ends the loop and the process. It runs in a session of its own, so a signal to the
API process's group (Ctrl-C, a shell's `kill %1`, an init that signals the group) reaches only
the API process, which drains and then shuts the core down.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec

from kvfleet_engine import logs
from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core import heap
from kvfleet_engine.core.capacity import measure_capacity
from kvfleet_engine.core.records import (
    CALLS,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    Call,
    CallResult,
    CoreFailed,
    CoreReady,
    Shutdown,
    StepOutputs,
    ToCore,
    encoder,
    to_core_decoder,
)
from kvfleet_engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kvfleet_engine.core.engine_core import EngineCore

log = logging.getLogger(__name__)


def run_engine_core(config: EngineConfig, conn: Connection, log_level: str = "INFO") -> None:
    """The core process's entry point (multiprocessing target)."""
    from kvfleet_engine.core.engine_core import EngineCore  # torch: only in this process

    os.setsid()  # out of the API process's group: its SIGTERM drains through this process
    logs.configure(log_level, "engine-core")
    encode = encoder().encode
    started = time.perf_counter()
    try:
        core = EngineCore.from_config(config)
    except ValueError as exc:  # a checkpoint that does not match its config, a corrupt file
        conn.send_bytes(encode(CoreFailed(str(exc), user_error=True)))
        return
    except Exception as exc:
        log.exception("engine core failed to start")
        conn.send_bytes(encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        raise SystemExit(1) from exc
    ready = CoreReady(
        protocol_version=PROTOCOL_VERSION,
        pid=os.getpid(),
        num_blocks=core.kv_cache.num_blocks,
        block_size=core.kv_cache.block_size,
        device=str(core.model_runner.device),
        load_s=time.perf_counter() - started,
    )
    loop = CoreLoop(core, conn)
    workers = core.model_runner.workers
    if workers is not None:  # a rank that dies ends the core at once, with the reason
        workers.on_failure = loop.fail
    conn.send_bytes(encode(ready))
    heap.settle()  # the model's objects live to the end: out of every collection
    core.profile.track_gc()
    try:
        loop.run()
    except (BrokenPipeError, ConnectionResetError):
        log.info("API process went away; engine core exits")
    except Exception as exc:
        log.exception("engine core step loop died")
        try:
            conn.send_bytes(encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass
        raise SystemExit(1) from exc
    finally:
        core.model_runner.shutdown()


class CoreLoop:
    """Commands in, steps out, until shutdown or the API process goes away."""

    def __init__(self, core: EngineCore, conn: Connection) -> None:
        self.core = core
        self.conn = conn
        self.encode = encoder().encode
        # Records go out whole: the step loop and a rank's failure (another thread) both send.
        self._send_lock = threading.Lock()
        # Decoded commands from the input thread; None: the pipe closed.
        self.commands: queue.SimpleQueue[ToCore | None] = queue.SimpleQueue()
        self._calls: dict[str, Any] = {
            "measure_capacity": self._measure_capacity,
            "set_token_budget": self._set_token_budget,
            "stats": core.stats,
            "profile": core.profile.snapshot,
        }
        assert set(self._calls) == set(CALLS)

    def run(self) -> None:
        reader = threading.Thread(target=self._read, name="kvfleet-core-input", daemon=True)
        reader.start()
        core, profile, clock = self.core, self.core.profile, time.perf_counter
        while True:
            began = clock()
            if core.has_unfinished_requests():
                commands = self._queued()
            else:  # idle: block until a command comes (no polling, no timeout)
                commands = [self.commands.get(), *self._queued()]
                profile.add("idle", clock() - began)
                began = clock()
            aborted = False
            for command in commands:
                if command is None or isinstance(command, Shutdown):
                    log.info("engine core shutting down")
                    return
                aborted |= self._apply(command)
            if commands:
                profile.add("commands", clock() - began, len(commands))
            if core.has_unfinished_requests():
                self._send(core.step_outputs())
            elif aborted:  # an abort emptied the engine: no step reports the freed blocks
                self._send(StepOutputs([], [], time.time(), core.stats()))

    def _queued(self) -> list[ToCore | None]:
        """Every command queued now, without waiting."""
        commands: list[ToCore | None] = []
        try:
            while True:
                commands.append(self.commands.get_nowait())
        except queue.Empty:
            return commands

    def _apply(self, command: ToCore) -> bool:
        """Apply one command; True if it was an abort."""
        if isinstance(command, AddRequest):
            self._add(command)
        elif isinstance(command, AbortRequests):
            self.core.abort_request(command.request_ids)
            return True
        elif isinstance(command, Call):
            self._call(command)
        return False

    def _add(self, command: AddRequest) -> None:
        try:
            params = SamplingParams(**command.params)
            self.core.add_request(
                command.request_id,
                command.prompt_token_ids,
                params,
                priority=command.priority,
                arrival_time=command.arrival_time,
            )
        except (ValueError, TypeError) as exc:  # the API process checks first: rare
            stats = self.core.stats()
            self._send(
                StepOutputs([], [], time.time(), stats, rejected={command.request_id: str(exc)})
            )

    def _call(self, command: Call) -> None:
        handler = self._calls.get(command.name)
        if handler is None:
            result = CallResult(command.call_id, error=f"unknown call {command.name!r}")
        else:
            try:
                result = CallResult(command.call_id, result=handler(**command.args))
            except Exception as exc:
                log.exception("call %s failed", command.name)
                result = CallResult(command.call_id, error=f"{type(exc).__name__}: {exc}")
        self._send(result)

    def _measure_capacity(self, decode_batches: list[int], prefill_tokens: int) -> Any:
        small, large = decode_batches
        return measure_capacity(
            self.core, decode_batches=(small, large), prefill_tokens=prefill_tokens
        )

    def _set_token_budget(self, num_tokens: int) -> None:
        self.core.scheduler.set_token_budget(num_tokens)

    def _send(self, record: msgspec.Struct) -> None:
        began = time.perf_counter()
        payload = self.encode(record)
        with self._send_lock:
            self.conn.send_bytes(payload)
        self.core.profile.add("send", time.perf_counter() - began)

    def fail(self, reason: str) -> None:
        """A rank of the replica died or failed (monitor thread): tell the API process why and
        exit now, whatever the step loop is doing (it may wait on the dead rank)."""
        log.error("%s: engine core exits", reason)
        try:
            with self._send_lock:
                self.conn.send_bytes(self.encode(CoreFailed(reason)))
        except OSError:
            pass
        os._exit(1)

    def _read(self) -> None:
        """Input thread: receive and decode commands (the recv releases the GIL, so this
        overlaps with the step loop)."""
        decode = to_core_decoder().decode
        try:
            while True:
                self.commands.put(decode(self.conn.recv_bytes()))
        except (EOFError, OSError):
            log.info("API process closed the pipe")
        except msgspec.DecodeError:
            log.exception("undecodable command; engine core stops")
        self.commands.put(None)
