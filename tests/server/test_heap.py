"""core.heap.settle, which both serving processes call once started: what was alive then is out of
every later collection, and the in-flight state of many streams no longer sets off collections
(the API process's full collections at 1,024 streams: bench/cpu_gc_probe.sh)."""

from __future__ import annotations

import gc

from kvfleet_engine.core import heap

IN_FLIGHT = 5_000  # container objects alive at once, as many streams' state is


def _collections_while_holding(count: int) -> int:
    """Collections of any generation that holding `count` new lists alive sets off."""
    before = sum(s["collections"] for s in gc.get_stats())
    held = [[] for _ in range(count)]
    after = sum(s["collections"] for s in gc.get_stats())
    del held
    return after - before


def test_settle_freezes_start_up_and_holding_many_streams_sets_off_no_collection() -> None:
    before = gc.get_threshold()
    start_up = [bytearray(8)]  # a list: tracked by the collector
    try:
        gc.set_threshold(700, 10, 10)  # CPython's
        assert _collections_while_holding(IN_FLIGHT) > 0
        heap.settle()
        assert not any(o is start_up for o in gc.get_objects())  # frozen: no collection sees it
        assert _collections_while_holding(IN_FLIGHT) == 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
