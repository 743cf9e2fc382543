"""The one interface every routing strategy implements.

rank(request, replicas) -> Ranking   best first; the rest are the retry order
routed(request, replica)             the replica took the request (a 2xx answer): strategies
                                     may learn where its prompt is now
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvfleet_router.replicas import Replica


@dataclass(frozen=True)
class RoutedRequest:
    """What a strategy may look at."""

    block_hashes: Sequence[int]  # chained prefix-block hashes of the prompt (prefix.py)


@dataclass(frozen=True)
class Ranking:
    """A strategy's answer for one request."""

    replicas: tuple[Replica, ...]  # every available replica, best first
    reason: str  # why the first was chosen (kvfleet_router_routing_decisions_total{reason})
    matched_blocks: int = 0  # prefix blocks the first replica is believed to hold


class Strategy(Protocol):
    name: str  # the --strategy value

    def rank(self, request: RoutedRequest, replicas: Sequence[Replica]) -> Ranking: ...

    def routed(self, request: RoutedRequest, replica: Replica) -> None: ...


def by_load(replicas: Sequence[Replica], turn: int) -> list[Replica]:
    """Least load first, then least KV usage; equal replicas take turns (`turn` rotates them),
    so an idle fleet does not send everything to one replica."""
    count = len(replicas)
    return [
        replicas[i]
        for i in sorted(
            range(count),
            key=lambda i: (replicas[i].load, replicas[i].kv_usage, (i - turn) % count),
        )
    ]
