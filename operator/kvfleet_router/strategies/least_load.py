"""least-load: the replica with the fewest requests in flight and queued."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet_router.replicas import Replica
from kvfleet_router.strategies.base import Ranking, RoutedRequest, by_load


class LeastLoad:
    name = "least-load"

    def __init__(self) -> None:
        self._turn = 0

    def rank(self, request: RoutedRequest, replicas: Sequence[Replica]) -> Ranking:
        self._turn += 1
        return Ranking(tuple(by_load(replicas, self._turn)), "least-load")

    def routed(self, request: RoutedRequest, replica: Replica) -> None:
        pass
