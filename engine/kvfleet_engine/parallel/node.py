"""A compute-only host of a multi-node replica: `kvfleet serve --nnodes N --node-rank R` with
R > 0. It starts this host's ranks (R * k .. R * k + k - 1, k = world size / nnodes: ranks are
numbered node by node), which reach the leader's step channel and torch.distributed at
--master-addr / --master-port, and answers on --port only:

    /health  200 {"status": "ok"} while every rank of this host runs (also while they start);
             503 {"status": "unhealthy", "reason": ...} once one failed, exited, could not
             reach the leader within --parallel-join-timeout, or lost it
    /ready   200 {"status": "ready"} once every rank of this host joined, loaded its weights and
             allocated its KV cache; 503 {"status": "starting"} before
    anything else: 404

A rank that fails ends the host: its reason is logged and answered on /health for a moment
(`FAILURE_GRACE_S`), the other ranks are stopped, and `serve` returns 1 (Kubernetes restarts
the pod, and the group with it). A rank the leader stopped (it shut down), SIGTERM or SIGINT
stop the ranks and return 0. The leader
schedules, samples and serves the API; it sees this host's ranks go as closed step channels."""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType

from kvfleet_engine.config import EngineConfig

log = logging.getLogger(__name__)

# After a rank failed: how long /health answers 503 before the process exits.
FAILURE_GRACE_S = 1.0
NOT_SERVED = "not served here: this node only computes; send requests to the leader (node 0)"
# Seconds the ranks get to stop after Stop / SIGTERM before they are killed.
STOP_TIMEOUT_S = 10.0
# Seconds a connection may take to send its request (a probe's takes one round trip): past it
# the connection is closed, so a stalled client does not hold a thread (`kvfleet serve
# --header-timeout`'s default on the leader).
REQUEST_TIMEOUT_S = 10.0


def _run_rank(config: EngineConfig, rank: int, status: Connection, log_level: str) -> None:
    """The rank process's target (imports torch there, not in the launcher)."""
    from kvfleet_engine.parallel.worker import run_worker

    run_worker(config, rank, status, log_level)


@dataclass
class NodeHealth:
    """What /health and /ready answer; written by the launcher's loop, read by HTTP threads."""

    ranks: int  # this host's ranks
    ready_ranks: int = 0
    failure: str | None = None  # why this host cannot go on

    def health(self) -> tuple[int, dict[str, str]]:
        if self.failure is not None:
            return 503, {"status": "unhealthy", "reason": self.failure}
        return 200, {"status": "ok"}

    def ready(self) -> tuple[int, dict[str, str]]:
        if self.failure is None and self.ready_ranks == self.ranks:
            return 200, {"status": "ready"}
        return 503, {"status": "dead" if self.failure is not None else "starting"}


def _handler(state: NodeHealth) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # the connection's socket timeout: a stalled read ends it

        def _answer(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                code, body = state.health()
            elif path == "/ready":
                code, body = state.ready()
            else:
                code, body = 404, {"error": f"{path}: {NOT_SERVED}"}
            payload = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _answer

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: %s", format % args)

    return Handler


class ComputeNode:
    """This host's ranks and the HTTP endpoint that reports them."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        self.config = config
        self.log_level = log_level
        ranks = config.parallel.node_ranks
        self.state = NodeHealth(ranks=len(ranks))
        self.processes: dict[int, BaseProcess] = {}
        self.status: dict[int, Connection] = {}  # rank -> the launcher's end of its pipe
        self._stop = threading.Event()

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        for rank in self.config.parallel.node_ranks:
            mine, theirs = context.Pipe()  # duplex: the rank sees it close if this process dies
            process = context.Process(
                target=_run_rank,
                args=(self.config, rank, theirs, self.log_level),
                name=f"kvfleet-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.processes[rank], self.status[rank] = process, mine
        log.info(
            "node %d of %d: ranks %s started (pids %s); the leader is %s:%d",
            self.config.parallel.node_rank,
            self.config.parallel.nnodes,
            list(self.processes),
            [p.pid for p in self.processes.values()],
            self.config.parallel.master_addr,
            self.config.parallel.master_port,
        )

    def watch(self) -> int:
        """Follow the ranks until one fails (returns 1) or stop() is called (returns 0)."""
        by_conn = {conn: rank for rank, conn in self.status.items()}
        by_sentinel = {p.sentinel: rank for rank, p in self.processes.items()}
        open_conns = set(by_conn)
        stopped = False
        while not self._stop.is_set():
            ready = wait([*open_conns, *by_sentinel], timeout=0.2)
            for item in ready:
                if item in by_conn:
                    rank = by_conn[item]
                    try:
                        message = item.recv()
                    except (EOFError, OSError):
                        open_conns.discard(item)
                        continue
                    if message == "ready":
                        self.state.ready_ranks += 1
                        ready_ranks, ranks = self.state.ready_ranks, self.state.ranks
                        log.info("rank %d ready (%d of %d)", rank, ready_ranks, ranks)
                    else:
                        self._fail(str(message))
            for sentinel, rank in by_sentinel.items():
                if sentinel in ready and self.state.failure is None:
                    process = self.processes[rank]
                    process.join(1)
                    self._drain_reason(rank)  # its own reason, sent just before it exited
                    if self.state.failure is None and process.exitcode == 0:
                        # The leader sent Stop: the replica is over, not this host at fault.
                        self.state.failure = f"the leader stopped rank {rank}"
                        log.info("%s: this node stops", self.state.failure)
                        stopped = True
                    if self.state.failure is None:
                        self._fail(
                            f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                        )
            if self.state.failure is not None:
                if stopped:
                    return 0
                time.sleep(FAILURE_GRACE_S)  # /health reports it meanwhile
                return 1
        return 0

    def _drain_reason(self, rank: int) -> None:
        conn = self.status[rank]
        try:
            while conn.poll(0):
                message = conn.recv()
                if message != "ready":
                    self._fail(str(message))
        except (EOFError, OSError):
            pass

    def _fail(self, reason: str) -> None:
        if self.state.failure is None:
            self.state.failure = reason
            log.error("%s: this node cannot go on", reason)

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes.values():
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                log.warning("rank process %s did not stop; killing it", process.pid)
                process.kill()
                process.join(5)
        for conn in self.status.values():
            conn.close()


def serve(config: EngineConfig, host: str, port: int, log_level: str = "INFO") -> int:
    """Run this host's ranks and answer /health and /ready until they end; the exit code."""
    node = ComputeNode(config, log_level.upper())
    server = ThreadingHTTPServer((host, port), _handler(node.state))
    server.daemon_threads = True
    http = threading.Thread(target=server.serve_forever, name="kvfleet-node-http", daemon=True)
    http.start()
    log.info("node %d: /health and /ready on %s:%d", config.parallel.node_rank, host, port)

    def on_signal(sig: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping this node's ranks", sig)
        node.stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        node.start()
        code = node.watch()
    finally:
        node.shutdown()
        server.shutdown()
        server.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code:
        reason = node.state.failure
        log.error("node %d exits with code %d: %s", config.parallel.node_rank, code, reason)
    return code
