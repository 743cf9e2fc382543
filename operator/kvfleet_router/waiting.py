"""The bounded queue of requests waiting for a replica: while a deployment scales up from zero,
or every replica is out (cooling down after a 503, unreachable). Its length is the router's
demand signal (`kvfleet_router_queued_requests`), which the operator's autoscaler reads to
scale 0 -> 1."""

from __future__ import annotations

import time
from collections.abc import Container

from kvfleet_router.replicas import Replica, ReplicaPool

POLL_S = 0.25  # re-check this often: cool-downs end without a notification


class QueueFull(Exception):
    """More requests wait than the queue holds."""


class WaitingQueue:
    def __init__(self, pool: ReplicaPool, max_size: int) -> None:
        self._pool = pool
        self.max_size = max_size
        self.num_waiting = 0  # requests waiting now

    def available(self, exclude: Container[str] = ()) -> list[Replica]:
        """The replicas a request may go to now (less `exclude`, by address)."""
        return [r for r in self._pool.available() if r.address not in exclude]

    async def wait(self, deadline: float, exclude: Container[str] = ()) -> list[Replica]:
        """Wait in the queue until a replica is available or `deadline` (monotonic) passes
        (then: empty). QueueFull when the queue has no room."""
        if self.num_waiting >= self.max_size:
            raise QueueFull
        self.num_waiting += 1
        try:
            found = self.available(exclude)
            while not found:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                await self._pool.wait_changed(min(remaining, POLL_S))
                found = self.available(exclude)
            return found
        finally:
            self.num_waiting -= 1
