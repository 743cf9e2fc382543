"""The strategies on their own: which replica each picks for a sequence of requests."""

from __future__ import annotations

import gc
import json
import os

from fake_engine import MODEL, chat

from kvfleet_router.prefix import block_hashes
from kvfleet_router.replicas import Replica, ReplicaPool
from kvfleet_router.strategies import RoutedRequest
from kvfleet_router.strategies.least_load import LeastLoad
from kvfleet_router.strategies.prefix import PrefixAffinity
from kvfleet_router.strategies.round_robin import RoundRobin

BLOCK = 64


def replicas(count: int) -> list[Replica]:
    return [Replica(f"10.0.0.{i}:8000", reachable=True) for i in range(count)]


def chat_request(*turns: str, system: str = "You are a helpful assistant. ") -> RoutedRequest:
    body = json.loads(chat(MODEL, *turns))
    body["messages"][0]["content"] = system * 20
    return RoutedRequest(block_hashes(body, chat=True, block_chars=BLOCK))


def send(strategy: PrefixAffinity, request: RoutedRequest, fleet: list[Replica]) -> Replica:
    ranking = strategy.rank(request, fleet)
    strategy.routed(request, ranking.replicas[0])
    return ranking.replicas[0]


def test_a_conversation_stays_on_one_replica() -> None:
    fleet = replicas(3)
    strategy = PrefixAffinity(BLOCK, load_factor=1.25)
    question = "What is the capital of France? " * 4
    answer = "Paris is the capital of France. " * 4
    first = send(strategy, chat_request(question), fleet)
    first.in_flight += 1  # the first turn still streams while others arrive
    for turn in range(2, 6):
        turns = [question, answer] * (turn - 1) + [question]
        ranking = strategy.rank(chat_request(*turns), fleet)
        assert ranking.replicas[0] is first
        assert ranking.reason == "prefix"
        assert ranking.matched_blocks > 0
        strategy.routed(chat_request(*turns), first)


def test_a_conversation_whose_turns_reach_different_routers_stays_on_one_replica() -> None:
    """Two router processes, each with its own view of the same three pods (as behind the
    router Service), each learning only what it routed: turns alternating between them land
    on one replica, the one the first block hashes to."""
    routers = [PrefixAffinity(BLOCK, load_factor=1.25) for _ in range(2)]
    views = [
        [Replica(f"10.0.0.{i}:8000", reachable=True, name=f"engine-{i}") for i in range(3)]
        for _ in routers
    ]
    question, answer = "How do I rotate a key? " * 4, "Create the new key first. " * 4
    for conversation in range(12):
        system = f"You are the support assistant of team {conversation}. "
        homes = set()
        for turn in range(1, 5):
            at = turn % 2
            request = chat_request(*([question, answer] * (turn - 1) + [question]), system=system)
            ranking = routers[at].rank(request, views[at])
            assert ranking.reason == ("hash" if turn < 3 else "prefix")  # each router's first
            routers[at].routed(request, ranking.replicas[0])
            homes.add(ranking.replicas[0].name)
        assert len(homes) == 1, (conversation, homes)


def test_every_router_process_hashes_a_prompts_first_block_alike() -> None:
    """Router pods are separate processes, each with its own salt for Python's hash: the first
    block, which places a new prompt, must hash the same in all of them, or each router would
    send a conversation's turns elsewhere."""
    import subprocess
    import sys

    code = (
        "import json, sys; from kvfleet_router.prefix import block_hashes; "
        "print(block_hashes(json.loads(sys.argv[1]), chat=True, block_chars=64)[0])"
    )
    body = json.dumps({"messages": [{"role": "system", "content": "Answer in French. " * 8}]})
    firsts = {
        subprocess.run(
            [sys.executable, "-c", code, body],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(firsts) == 1 and firsts.pop().strip().isdigit()


def test_a_new_prompt_goes_to_its_hashed_replica_until_that_is_over_the_load_bound() -> None:
    fleet = replicas(3)
    strategy = PrefixAffinity(BLOCK, load_factor=1.25)
    request = chat_request("hello")
    ranking = strategy.rank(request, fleet)
    home = ranking.replicas[0]
    assert ranking.reason == "hash"
    home.in_flight = 4  # the bound: 1.25 x (4 + 1) / 3 + 2 = 4.08, not over it
    assert strategy.rank(request, fleet).replicas[0] is home
    home.in_flight = 5  # 1.25 x 6 / 3 + 2 = 4.5: over it, another, and `home` the last resort
    ranking = strategy.rank(request, fleet)
    assert ranking.replicas[0] is not home and ranking.replicas[-1] is home


def test_what_is_kept_per_replica_goes_when_the_pool_drops_it() -> None:
    """Autoscaling and scale to zero bring new pod IPs all day: the prefix blocks learnt for a
    pod that left are freed with it, not kept for the router's lifetime."""
    pool = ReplicaPool()
    strategy = PrefixAffinity(BLOCK, load_factor=1.25)
    request = chat_request("What is the capital of France? " * 4)
    for generation in range(50):
        pool.set_members({f"10.0.{generation}.1:8000": f"engine-{generation}"}, reachable=True)
        send(strategy, request, pool.available())
    gc.collect()
    assert len(strategy._indexes) == 1  # the current member's
    (current,) = pool.members.values()
    assert strategy.rank(request, [current]).matched_blocks > 0


def test_tenants_with_their_own_system_prompts_spread_over_the_fleet() -> None:
    """Each tenant's system prompt gets a home by its hash, and the load bound keeps any
    replica from taking more than its share of tenants."""
    fleet = replicas(4)
    strategy = PrefixAffinity(BLOCK, load_factor=1.25)
    homes = {}
    for tenant in range(16):
        system = f"You are the assistant of tenant {tenant}. Answer briefly. "
        home = send(strategy, chat_request("hello", system=system), fleet)
        home.in_flight += 1
        homes[tenant] = home
        # Every later user of the tenant lands where its system prompt is.
        again = strategy.rank(chat_request("another user asks", system=system), fleet)
        assert again.replicas[0] is home
    assert len({r.address for r in homes.values()}) == 4
    # Never more than the bound at the last placement, 1.25 x (15 + 1) / 4 + 2 = 7, plus it.
    assert max(r.in_flight for r in fleet) <= 8


def test_an_overloaded_replica_spills_its_prefix_to_another() -> None:
    fleet = replicas(2)
    strategy = PrefixAffinity(BLOCK, load_factor=1.25)
    home = send(strategy, chat_request("hello"), fleet)
    home.in_flight = 10  # far above 1.25 x the mean load + the slack
    ranking = strategy.rank(chat_request("hello again"), fleet)
    assert ranking.replicas[0] is not home
    assert ranking.reason == "spill"
    assert ranking.replicas[1] is home  # still the fallback


def test_a_request_without_a_prompt_goes_to_the_least_loaded() -> None:
    fleet = replicas(3)
    fleet[0].in_flight, fleet[1].in_flight = 2, 1
    ranking = PrefixAffinity(BLOCK, 1.25).rank(RoutedRequest([]), fleet)
    assert ranking.replicas[0] is fleet[2]
    assert ranking.reason == "least-load"


def test_least_load_prefers_idle_replicas_and_rotates_between_equals() -> None:
    fleet = replicas(3)
    strategy = LeastLoad()
    request = RoutedRequest([])
    fleet[0].in_flight = 3
    picks = [strategy.rank(request, fleet).replicas[0] for _ in range(4)]
    assert fleet[0] not in picks
    assert {p.address for p in picks} == {fleet[1].address, fleet[2].address}
    fleet[1].in_flight = 1
    assert strategy.rank(request, fleet).replicas[0] is fleet[2]


def test_round_robin_takes_turns_whatever_the_load() -> None:
    fleet = replicas(3)
    fleet[0].in_flight = 100
    strategy = RoundRobin()
    picks = [strategy.rank(RoutedRequest([]), fleet).replicas[0] for _ in range(6)]
    assert [p.address for p in picks] == [r.address for r in fleet] * 2


def test_block_hashes_are_chained_and_block_aligned() -> None:
    text = "x" * 64 + "y" * 64 + "z" * 10
    hashes = block_hashes({"prompt": text}, chat=False, block_chars=64)
    assert len(hashes) == 2  # the 10 trailing characters are not a full block
    longer = block_hashes({"prompt": text + "w" * 200}, chat=False, block_chars=64)
    assert longer[:2] == hashes
    other = block_hashes({"prompt": "q" + text[1:]}, chat=False, block_chars=64)
    assert other[1] != hashes[1]  # a different first block changes every later hash
    tokens = block_hashes({"prompt": list(range(40))}, chat=False, block_chars=64)
    assert len(tokens) == 2  # 16 token ids per block
    assert block_hashes({"prompt": 5}, chat=False, block_chars=64) == []
    assert block_hashes({"messages": "nope"}, chat=True, block_chars=64) == []


def test_only_the_first_blocks_of_a_huge_prompt_are_hashed() -> None:
    """A prefix shared past MAX_BLOCKS blocks routes no better: the rest is not hashed (a 50 MB
    prompt hashed whole held the router's event loop for seconds)."""
    from kvfleet_router.prefix import MAX_BLOCKS, TOKEN_BLOCK

    text = "".join(chr(65 + i % 26) for i in range(BLOCK * (MAX_BLOCKS + 100)))
    hashes = block_hashes({"prompt": text}, chat=False, block_chars=BLOCK)
    head = block_hashes({"prompt": text[: BLOCK * MAX_BLOCKS]}, chat=False, block_chars=BLOCK)
    assert len(hashes) == MAX_BLOCKS and hashes == head
    ids = list(range(TOKEN_BLOCK * (MAX_BLOCKS + 5)))
    assert len(block_hashes({"prompt": ids}, chat=False, block_chars=BLOCK)) == MAX_BLOCKS
    ids[-1] = "not an id"  # past the hashed blocks: not read
    assert len(block_hashes({"prompt": ids}, chat=False, block_chars=BLOCK)) == MAX_BLOCKS
