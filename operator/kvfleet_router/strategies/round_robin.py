"""round-robin: each replica in turn, whatever it holds or does (the Service's spread, for
comparison)."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet_router.replicas import Replica
from kvfleet_router.strategies.base import Ranking, RoutedRequest


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def rank(self, request: RoutedRequest, replicas: Sequence[Replica]) -> Ranking:
        ordered = sorted(replicas, key=lambda r: r.address)
        start = self._next % len(ordered)
        self._next += 1
        return Ranking(tuple(ordered[start:] + ordered[:start]), "round-robin")

    def routed(self, request: RoutedRequest, replica: Replica) -> None:
        pass
