"""The driver's side of the other ranks: start this host's workers, wait for every rank
(this host's and other hosts') on the step channel through start-up, send each step's diff,
and notice at once when a rank dies or disconnects.

A dead rank is reported by `failure` (and to `on_failure`, from a monitor thread): its exit
code when it ran on this host, its closed connection otherwise. The driver runs each step's
exchanges with the ranks inside `step()`: collectives with a dead peer fail on gloo at once and
come out as `RankFailed` with the monitor's reason; one stuck on a dead peer (NCCL's case) ends
the process after FAILURE_EXIT_GRACE_S instead of hanging it."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TypeVar

import msgspec

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.parallel import messages
from kvfleet_engine.parallel.channel import authkey, listen_address, warn_if_default_key
from kvfleet_engine.parallel.listener import RankListener
from kvfleet_engine.parallel.messages import Failed, Hello, Stop

log = logging.getLogger(__name__)

R = TypeVar("R")

# Seconds a step may take to raise once a rank has failed before the process exits (a
# collective stuck on a dead peer, NCCL's case, would otherwise hang it).
FAILURE_EXIT_GRACE_S = 20.0


class RankFailed(RuntimeError):
    """A rank died, disconnected or failed; the replica cannot go on."""


class WorkerGroup:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        self.config = config
        self.parallel = config.parallel
        self.log_level = log_level
        self.conns: dict[int, Connection] = {}  # rank -> its step channel
        self.pids: dict[int, int] = {}
        self.processes: dict[int, BaseProcess] = {}  # this host's workers
        # Why the replica cannot go on (None: every rank is fine).
        self.failure: str | None = None
        # Called once, from the monitor thread, with the reason a rank failed.
        self.on_failure: Callable[[str], None] | None = None
        self._stopping = False
        self._monitor: threading.Thread | None = None
        self._in_step = False  # a step() runs
        self._exit_timer: threading.Timer | None = None

    @property
    def ranks(self) -> list[int]:
        return list(range(1, self.parallel.world_size))

    # ---- start-up -----------------------------------------------------------------------------

    def start(self) -> None:
        """Listen, start this host's workers and wait until every rank has connected."""
        warn_if_default_key(self.parallel)
        listener = RankListener(listen_address(self.parallel), authkey())
        context = multiprocessing.get_context("spawn")
        from kvfleet_engine.parallel.worker import run_worker

        for rank in self.parallel.node_ranks:
            if rank == 0:
                continue
            process = context.Process(
                target=run_worker,
                args=(self.config, rank, None, self.log_level),
                name=f"kvfleet-rank-{rank}",
                daemon=True,  # ended with the driver's process, however it exits
            )
            process.start()
            self.processes[rank] = process
        listener.start()
        deadline = time.monotonic() + self.parallel.join_timeout_s
        try:
            while listener.joined < len(self.ranks):
                self._check_processes("during start-up")
                if time.monotonic() > deadline:
                    raise RankFailed(
                        f"{listener.joined} of {len(self.ranks)} other ranks connected to "
                        f"{listen_address(self.parallel)} within "
                        f"{self.parallel.join_timeout_s:.0f} s"
                    )
                time.sleep(0.05)
        finally:
            accepted = listener.close()
        for conn in accepted[len(self.ranks) :]:  # more than the ranks: not one of this group's
            conn.close()
        accepted = accepted[: len(self.ranks)]
        for conn in accepted:
            hello = self._receive(conn, Hello, deadline)
            self.conns[hello.rank] = conn
            self.pids[hello.rank] = hello.pid
        log.info("every rank connected: %s", sorted(self.pids.items()))

    def expect(self, kind: type[R]) -> dict[int, R]:
        """One record of `kind` from every rank (start-up steps), failing fast on any rank's
        failure or death."""
        deadline = time.monotonic() + self.parallel.join_timeout_s
        return {rank: self._receive(conn, kind, deadline) for rank, conn in self.conns.items()}

    def _receive(self, conn: Connection, kind: type[R], deadline: float) -> R:
        while not conn.poll(0.05):
            self._check_processes("during start-up")
            if time.monotonic() > deadline:
                raise RankFailed(
                    f"a rank sent no {kind.__name__} within {self.parallel.join_timeout_s:.0f} s"
                )
        try:
            record = messages.from_worker.decode(conn.recv_bytes())
        except (EOFError, OSError):
            self._check_processes("during start-up")
            raise RankFailed("a rank closed its step channel during start-up") from None
        if isinstance(record, Failed):
            if record.user_error:
                raise ValueError(record.error)
            raise RankFailed(f"rank {record.rank} failed during start-up: {record.error}")
        if not isinstance(record, kind):
            raise RankFailed(f"expected {kind.__name__} from a rank, got {record!r}")
        return record

    def _check_processes(self, when: str) -> None:
        for rank, process in self.processes.items():
            if process.exitcode is not None:
                raise RankFailed(
                    f"rank {rank} (pid {process.pid}) exited with code {process.exitcode} {when}"
                )

    # ---- running ------------------------------------------------------------------------------

    def send(self, record: msgspec.Struct) -> None:
        """The same record to every rank."""
        payload = messages.encode(record)
        for rank, conn in self.conns.items():
            try:
                conn.send_bytes(payload)
            except OSError as error:
                raise RankFailed(self.wait_for_failure() or f"rank {rank}: {error}") from error

    def watch(self) -> None:
        """Start the monitor thread: from now on a rank that dies or sends Failed is reported."""
        self._monitor = threading.Thread(target=self._watch, name="kvfleet-ranks", daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        by_conn = {conn: rank for rank, conn in self.conns.items()}
        by_sentinel = {process.sentinel: rank for rank, process in self.processes.items()}
        waitables: list[object] = [*by_conn, *by_sentinel]
        ready = wait(waitables)  # type: ignore[arg-type]
        if self._stopping:
            return
        reason = None
        for item in ready:
            if item in by_sentinel:
                rank = by_sentinel[item]
                process = self.processes[rank]
                process.join(1)
                reason = f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                break
        if reason is None:
            conn = next(item for item in ready if item in by_conn)
            rank = by_conn[conn]
            try:
                record = messages.from_worker.decode(conn.recv_bytes())
                reason = (
                    f"rank {rank} failed: {record.error}"
                    if isinstance(record, Failed)
                    else f"rank {rank} sent {record!r} while running"
                )
            except (EOFError, OSError):
                reason = f"rank {rank} (pid {self.pids.get(rank)}) disconnected"
            local = self.processes.get(rank)
            if local is not None:
                local.join(1)
                if local.exitcode is not None:
                    reason = f"rank {rank} (pid {local.pid}) exited with code {local.exitcode}"
        if self._stopping:
            return
        self.failure = reason
        log.error("%s: the replica cannot go on", reason)
        self._arm_exit(reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Run a step's exchanges with the other ranks (`what` names them in a reason): raises
        RankFailed at once if a rank already failed, and for a collective that fails (with the
        monitor's reason when it has one)."""
        if self.failure is not None:
            self._cancel_exit()
            raise RankFailed(self.failure)
        self._in_step = True
        try:
            yield
        except RankFailed:
            self._cancel_exit()
            raise
        except RuntimeError as error:  # a collective with a dead rank
            reason = self.wait_for_failure() or f"{what} failed: {error}"
            self._cancel_exit()
            raise RankFailed(reason) from error
        finally:
            self._in_step = False

    def _arm_exit(self, reason: str) -> None:
        """From the monitor thread: a step stuck on the dead rank that does not raise soon ends
        the process (an idle driver raises at its next step)."""
        timer = threading.Timer(FAILURE_EXIT_GRACE_S, self._exit_if_stuck, args=(reason,))
        timer.daemon = True
        timer.start()
        self._exit_timer = timer

    def _exit_if_stuck(self, reason: str) -> None:
        if self._in_step:
            log.critical(
                "%s, and the step did not end in %.0f s: exiting", reason, FAILURE_EXIT_GRACE_S
            )
            os._exit(1)

    def _cancel_exit(self) -> None:
        if self._exit_timer is not None:
            self._exit_timer.cancel()

    def wait_for_failure(self, timeout_s: float = 2.0) -> str | None:
        """The failure's reason, giving the monitor up to `timeout_s` to find it (a collective
        can fail a moment before the monitor sees the rank gone)."""
        deadline = time.monotonic() + timeout_s
        while self.failure is None and time.monotonic() < deadline:
            if self._monitor is None or not self._monitor.is_alive():
                break
            time.sleep(0.02)
        return self.failure

    # ---- the end ------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every rank; this host's workers are killed if they do not exit in time."""
        if self._stopping:
            return
        self._stopping = True
        for conn in self.conns.values():
            try:
                conn.send_bytes(messages.encode(Stop()))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                log.warning("rank process %s did not stop; killing it", process.pid)
                process.kill()
                process.join(5)
        for conn in self.conns.values():
            conn.close()
