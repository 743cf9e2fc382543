"""prefix (default): the replica that holds the longest prefix of the prompt, within a load
bound; with no prefix anywhere, the prompt's own replica by rendezvous hashing of its first
block, within the same load bound.

The router remembers, per replica, the prefix blocks of the requests that replica answered
with a 2xx (prefix_index; one that failed or declined a prompt does not hold it), sized like
its KV cache. Bounded load as in consistent hashing with bounded loads (KubeAI's
CHWBL): a replica whose load exceeds load_factor x (total load + 1) / replicas takes no request
by prefix, which then goes to the best replica under the bound and is remembered there too, so
a hot prefix spreads over as many replicas as its load needs. Unlike CHWBL the bound has an
absolute slack of SPILL_SLACK requests: an engine batches, so a few more requests on one replica
cost little, while a prefix miss costs the whole prefill (without it, two requests of one
tenant on an idle fleet of three would already land on two replicas).

Several routers in front of one fleet (routing.replicas) each learn only what they routed, so
they must place what they have not seen the same way, or a conversation whose turns reach
different routers lands anywhere. A prompt a router has seen nowhere goes to the replica whose
name hashes highest with the prompt's first block (rendezvous hashing; names are the pods', the
same in every router), unless that replica is over the load bound: every router then learns a
tenant's system prompt at the same replica, and each turn, at whichever router, matches it
there. (Placing by load, on the least loaded replica, split 44% of the conversations of
bench/router_prefix.py over two routers: each router counts its own requests in flight, so
their load views, and their choices, differ.)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from kvfleet_router.prefix import stable_hash
from kvfleet_router.prefix_index import PrefixIndex, capacity_blocks
from kvfleet_router.replicas import Replica
from kvfleet_router.strategies.base import Ranking, RoutedRequest, by_load

SPILL_SLACK = 2.0  # requests a replica may hold above the relative bound before spilling


class PrefixAffinity:
    name = "prefix"

    def __init__(self, block_chars: int, load_factor: float) -> None:
        self._block_chars = block_chars
        self._load_factor = load_factor
        # replica -> its blocks; an entry goes with the replica (a pod that left: its index
        # would otherwise stay for the router's lifetime, one per pod IP ever seen).
        self._indexes: weakref.WeakKeyDictionary[Replica, PrefixIndex] = weakref.WeakKeyDictionary()
        self._turn = 0

    def rank(self, request: RoutedRequest, replicas: Sequence[Replica]) -> Ranking:
        self._turn += 1
        ordered = by_load(replicas, self._turn)
        hashes = request.block_hashes
        if not hashes:
            return Ranking(tuple(ordered), "least-load")
        total = sum(r.load for r in replicas)
        bound = self._load_factor * (total + 1) / len(replicas) + SPILL_SLACK
        matched = {r.address: self._index(r).match(hashes) for r in ordered}
        if max(matched.values()) == 0:  # seen nowhere: its hashed replica, within the bound
            ranked = sorted(
                ordered, key=lambda r: (r.load > bound, -rendezvous_weight(hashes[0], r.name))
            )
            return Ranking(tuple(ranked), "hash")
        # Stable sort: equal (bound, match) keep the load order.
        ranked = sorted(ordered, key=lambda r: (r.load > bound, -matched[r.address]))
        best = ranked[0]
        reason = "prefix" if matched[best.address] else "spill"
        return Ranking(tuple(ranked), reason, matched[best.address])

    def routed(self, request: RoutedRequest, replica: Replica) -> None:
        if request.block_hashes:
            self._index(replica).add(request.block_hashes)

    def _index(self, replica: Replica) -> PrefixIndex:
        sample = replica.sample
        capacity = capacity_blocks(
            sample.num_gpu_blocks if sample else None,
            sample.block_size if sample else None,
            self._block_chars,
        )
        index = self._indexes.get(replica)
        if index is None:
            index = self._indexes[replica] = PrefixIndex(capacity)
        elif index.capacity != capacity:
            index.resize(capacity)
        return index


def rendezvous_weight(block: int, replica_name: str) -> int:
    """The same number for (block, name) in every router process (not Python's salted hash)."""
    return stable_hash(f"{block}/{replica_name}".encode())
