"""The router's Prometheus metrics, in its own registry: the one module that imports
prometheus_client. README "Router" lists them.

Counters and histograms are fed by the proxy; the gauges (queue, in flight, idle time,
replicas) are read from the live objects at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvfleet_router.replicas import ReplicaPool
from kvfleet_router.waiting import WaitingQueue

# Outcomes of requests a replica answered (label replica: its pod's name, as X-Kvfleet-Replica)...
SUCCESS, CLIENT_ERROR, ENGINE_ERROR = "success", "client_error", "engine_error"
DISCONNECTED, BROKEN = "disconnected", "broken"  # client went away; replica went away mid-way
TIMEOUT = "timeout"  # the replica sent nothing within the upstream timeouts (504, stream cut)
# ...and of requests the router answered itself (replica="").
BAD_REQUEST, UNKNOWN_MODEL = "bad_request", "unknown_model"
QUEUE_FULL, QUEUE_TIMEOUT = "queue_full", "queue_timeout"
# Why a request went on to another replica (kvfleet_router_retries_total): a 429 or 503, no
# connection, or an attempt that failed after it was sent (LOST: the connection closed;
# TIMED_OUT: no headers, or body, in time). Each series exists from start-up at 0, so a
# dashboard's rate of it is 0, not "no data", until the first retry.
LOST, TIMED_OUT = "lost", "timeout"
RETRY_REASONS = ("429", "503", "connect", LOST, TIMED_OUT)

ADDED_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip
QUEUE_WAIT_BUCKETS = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)


class RouterMetrics:
    def __init__(self, strategy: str, pool: ReplicaPool, queue: WaitingQueue) -> None:
        self.strategy = strategy
        self.registry = CollectorRegistry(auto_describe=True)
        self.num_in_flight = 0  # requests between arrival and their last byte
        self._last_activity = time.monotonic()  # a request arrived or finished
        self._requests = Counter(
            "kvfleet_router_requests",
            "Requests by the replica that answered (empty: the router) and outcome.",
            ["replica", "outcome"],
            registry=self.registry,
        )
        self._decisions = Counter(
            "kvfleet_router_routing_decisions",
            "Routing decisions by strategy and reason (prefix, spill, hash, least-load, "
            "round-robin).",
            ["strategy", "reason"],
            registry=self.registry,
        )
        self._retries = Counter(
            "kvfleet_router_retries",
            "Requests sent to another replica, by why (429, 503, connect, lost, timeout).",
            ["reason"],
            registry=self.registry,
        )
        for reason in RETRY_REASONS:
            self._retries.labels(reason)
        self._prefix_blocks = Counter(
            "kvfleet_router_prefix_blocks",
            "Prompt prefix blocks of routed requests.",
            registry=self.registry,
        )
        self._prefix_hit_blocks = Counter(
            "kvfleet_router_prefix_hit_blocks",
            "Of those, blocks the chosen replica was believed to hold (prefix-hit estimate: "
            "the ratio of the two).",
            registry=self.registry,
        )
        self._added = Histogram(
            "kvfleet_router_added_latency_seconds",
            "Router time before a request is sent upstream (parse, route, connect), without "
            "time spent waiting for a replica.",
            buckets=ADDED_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._queue_wait = Histogram(
            "kvfleet_router_queue_wait_seconds",
            "Time requests waited for a replica (only those that had to wait).",
            buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_LiveGauges(self, pool, queue))

    # --- inputs ----------------------------------------------------------------------------

    def started(self) -> None:
        self.num_in_flight += 1
        self._last_activity = time.monotonic()

    def finished(self, replica: str, outcome: str) -> None:
        self.num_in_flight -= 1
        self._last_activity = time.monotonic()
        self._requests.labels(replica, outcome).inc()

    def routed(self, reason: str, num_blocks: int, matched_blocks: int) -> None:
        self._decisions.labels(self.strategy, reason).inc()
        if num_blocks:
            self._prefix_blocks.inc(num_blocks)
            self._prefix_hit_blocks.inc(matched_blocks)

    def retried(self, reason: str) -> None:
        assert reason in RETRY_REASONS, reason
        self._retries.labels(reason).inc()

    def observe_added_latency(self, seconds: float) -> None:
        self._added.observe(seconds)

    def observe_queue_wait(self, seconds: float) -> None:
        self._queue_wait.observe(seconds)

    def idle_seconds(self, num_queued: int) -> float:
        """Seconds since the last request arrived or finished; 0 while any is in flight."""
        if self.num_in_flight or num_queued:
            return 0.0
        return time.monotonic() - self._last_activity

    # --- output ----------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """(exposition text, content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LiveGauges(Collector):
    def __init__(self, metrics: RouterMetrics, pool: ReplicaPool, queue: WaitingQueue) -> None:
        self._metrics, self._pool, self._queue = metrics, pool, queue

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        queued = self._queue.num_waiting
        yield _gauge(
            "kvfleet_router_queued_requests",
            "Requests waiting for a replica (the autoscaler's scale-from-zero signal).",
            queued,
        )
        yield _gauge(
            "kvfleet_router_requests_in_flight",
            "Requests between arrival and their last byte, waiting ones included.",
            self._metrics.num_in_flight,
        )
        yield _gauge(
            "kvfleet_router_idle_seconds",
            "Seconds since a request last arrived or finished; 0 while any is in flight "
            "(the autoscaler's scale-to-zero signal).",
            self._metrics.idle_seconds(queued),
        )
        available = {r.address for r in self._pool.available()}
        replicas = GaugeMetricFamily(
            "kvfleet_router_replicas",
            "Replicas known to the router, by state (available, out).",
            labels=["state"],
        )
        replicas.add_metric(["available"], len(available))
        replicas.add_metric(["out"], len(self._pool.members) - len(available))
        yield replicas
        in_flight = GaugeMetricFamily(
            "kvfleet_router_replica_in_flight",
            "Requests in flight per replica (this router's).",
            labels=["replica"],
        )
        for replica in sorted(self._pool.members.values(), key=lambda r: r.name):
            in_flight.add_metric([replica.name], replica.in_flight)
        yield in_flight


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, doc)
    gauge.add_metric([], float(value))
    return gauge
