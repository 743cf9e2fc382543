"""The KV block pool: allocation, reference counts, prefix hits, collisions, LRU eviction."""

from __future__ import annotations

import pytest

from kvfleet_engine import kv_cache
from kvfleet_engine.kv_cache import KVCacheManager
from kvfleet_engine.request import Request
from kvfleet_engine.sampling import SamplingParams


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def admit(manager: KVCacheManager, req: Request) -> list[int] | None:
    """What the scheduler does: look up the prefix, then allocate the rest."""
    hits = manager.get_computed_blocks(req)
    num_cached = len(hits) * manager.block_size
    if manager.allocate_slots(req, req.num_tokens - num_cached, hits) is None:
        return None
    req.num_computed_tokens = req.num_tokens
    return hits


def test_allocate_counts_blocks_and_free_returns_them() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    req = request("a", list(range(10)))
    assert manager.allocate_slots(req, 10) == [0, 1, 2]
    assert manager.num_free_blocks == 5 and manager.usage == pytest.approx(3 / 8)
    req.num_computed_tokens = 10
    assert manager.allocate_slots(req, 2) == []  # fits in the third block
    req.num_computed_tokens = 12
    assert manager.allocate_slots(req, 1) == [3]
    manager.free(req)
    assert manager.num_free_blocks == 8 and req.block_ids == []


def test_no_room_returns_none_and_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    big = request("big", list(range(12)))
    assert manager.allocate_slots(big, 12) is not None
    other = request("other", list(range(100, 108)))
    assert manager.allocate_slots(other, 8) is None
    assert other.block_ids == [] and manager.num_free_blocks == 1


def test_prefix_hit_shares_blocks_with_reference_counts() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = request("a", list(range(10)))
    assert admit(manager, first) == []
    second = request("b", [*range(8), 50, 51, 52])
    hits = admit(manager, second)
    assert hits == first.block_ids[:2]
    assert manager.blocks[hits[0]].ref_count == 2
    manager.free(first)
    assert manager.blocks[hits[0]].ref_count == 1
    assert manager.num_free_blocks == 10 - 3  # second holds 2 shared + 1 own


def test_the_last_prompt_token_is_always_computed() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    admit(manager, request("a", list(range(8))))
    # Identical 8-token prompt: only the first block may be reused, the last token is computed.
    assert len(manager.get_computed_blocks(request("b", list(range(8))))) == 1


def test_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "hash_block", lambda parent, tokens: b"same")
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    admit(manager, request("a", [1, 2, 3, 4, 5]))
    assert manager.get_computed_blocks(request("b", [9, 9, 9, 9, 5])) == []
    assert len(manager.get_computed_blocks(request("c", [1, 2, 3, 4, 6]))) == 1


def test_freed_blocks_stay_cached_and_lru_evicts_oldest_first() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    old, new = request("old", [*range(8), 99]), request("new", [*range(20, 28), 99])
    admit(manager, old)
    admit(manager, new)
    manager.free(old)
    manager.free(new)
    assert manager.num_free_blocks == 6 and manager.usage == 0.0
    # Needs 3 blocks: the 2 uncached ones first, then the least recently freed cached one,
    # which is old's last full block (tails are evicted before heads).
    filler = request("filler", list(range(200, 212)))
    admit(manager, filler)
    assert len(manager.get_computed_blocks(request("x", [*range(8), 1]))) == 1
    assert len(manager.get_computed_blocks(request("y", [*range(20, 28), 1]))) == 2


def test_prefix_caching_off_never_hits() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    admit(manager, request("a", list(range(9))))
    assert manager.get_computed_blocks(request("b", list(range(9)))) == []
