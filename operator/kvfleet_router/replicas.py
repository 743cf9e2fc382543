"""The replicas the router may send requests to: one `Replica` per engine, in one `ReplicaPool`.

A replica is available while it is a member (discovery put it there), reachable (its last
/metrics scrape, and its last connection, worked) and not cooling down (it answered 503 and
said when to come back). Its load is what the strategies compare.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_COOL_DOWN_S = 1.0  # a 503 without Retry-After keeps the replica out this long
MIN_COOL_DOWN_S, MAX_COOL_DOWN_S = 0.25, 30.0  # whatever its Retry-After says


@dataclass(frozen=True)
class LoadSample:
    """One read of one engine's /metrics (the gauges the router routes on)."""

    waiting: float  # kvfleet_requests_waiting (vllm:num_requests_waiting)
    running: float  # kvfleet_requests_running (vllm:num_requests_running)
    kv_usage: float  # kvfleet_kv_cache_usage_ratio (vllm:kv_cache_usage_perc), 0..1
    num_gpu_blocks: int | None  # vllm:cache_config_info{num_gpu_blocks}; None if not exported
    block_size: int | None  # vllm:cache_config_info{block_size}, tokens per KV block
    model_names: frozenset[str]  # the `model_name` labels: what the engine serves


class Replica:
    """One engine replica, by address (host:port)."""

    # __weakref__: what a strategy keeps per replica goes when the pool drops the replica.
    __slots__ = (
        "__weakref__", "address", "cool_until", "in_flight", "name", "reachable", "sample", "url",
    )  # fmt: skip

    def __init__(self, address: str, *, reachable: bool, name: str = "") -> None:
        self.address = address  # "10.0.0.7:8000"
        # What clients are told (X-Kvfleet-Replica): the pod's name; the address without one.
        self.name = name or address
        self.url = f"http://{address}"  # base URL, no trailing slash
        self.in_flight = 0  # requests this router has sent there and not finished
        self.sample: LoadSample | None = None  # newest scrape
        self.reachable = reachable  # last scrape / connection worked
        self.cool_until = 0.0  # monotonic time before which it gets no new requests

    @property
    def load(self) -> float:
        """Requests this router has in flight there, plus the engine's own queue (which also
        holds other clients' requests)."""
        waiting = self.sample.waiting if self.sample is not None else 0.0
        return self.in_flight + waiting

    @property
    def kv_usage(self) -> float:
        return self.sample.kv_usage if self.sample is not None else 0.0

    def __repr__(self) -> str:
        return (
            f"Replica({self.name} at {self.address}, in_flight={self.in_flight}, "
            f"load={self.load:g})"
        )


class ReplicaPool:
    """The current members, and a way to wait until one is available."""

    def __init__(self) -> None:
        self.members: dict[str, Replica] = {}  # address -> replica
        self._changed = asyncio.Event()

    def set_members(self, names: Mapping[str, str], *, reachable: bool) -> None:
        """Make the members exactly `names` (address -> pod name); new ones start `reachable` or
        not (a Kubernetes-ready endpoint is; a static URL waits for its first scrape). An
        address that now names another pod (its IP reused) is a new member: nothing learnt
        about the old pod carries over."""
        wanted = {address: name or address for address, name in names.items()}
        for address, member in list(self.members.items()):
            if wanted.get(address) != member.name:
                del self.members[address]
        for address, name in wanted.items():
            if address not in self.members:
                self.members[address] = Replica(address, reachable=reachable, name=name)
        self._notify()

    def available(self, now: float | None = None) -> list[Replica]:
        """Members that may get a new request now."""
        now = time.monotonic() if now is None else now
        return [r for r in self.members.values() if self.is_available(r, now)]

    def is_available(self, replica: Replica, now: float | None = None) -> bool:
        """Whether `replica` may get a new request now: still a member (not removed, not
        replaced by a new pod at its address), reachable and not cooling down."""
        now = time.monotonic() if now is None else now
        return (
            self.members.get(replica.address) is replica
            and replica.reachable
            and replica.cool_until <= now
        )

    def observe_scrape(self, replica: Replica, sample: LoadSample | None) -> None:
        """A scrape result: a sample makes the replica reachable again, None unreachable."""
        was = replica.reachable
        replica.reachable = sample is not None
        if sample is not None:
            replica.sample = sample
        if replica.reachable and not was:
            self._notify()

    def connect_failed(self, replica: Replica) -> None:
        """Out until a scrape reaches it again."""
        replica.reachable = False

    def cool_down(self, replica: Replica, seconds: float | None) -> None:
        """Out for `seconds` (its Retry-After), or DEFAULT_COOL_DOWN_S."""
        delay = DEFAULT_COOL_DOWN_S if seconds is None else seconds
        delay = max(MIN_COOL_DOWN_S, min(delay, MAX_COOL_DOWN_S))
        replica.cool_until = time.monotonic() + delay

    async def wait_changed(self, timeout: float) -> None:
        """Return when membership or reachability changed, or after `timeout` seconds."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
