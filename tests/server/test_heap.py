"""core.heap.settle, which both serving processes call once started: what was alive then is out of
every later collection, and young objects are collected every GEN0_THRESHOLD allocations (the
API process's full collections at 1,024 streams: bench/cpu_gc_probe.sh)."""

from __future__ import annotations

import gc

from kvfleet_engine.core import heap


def test_settle_freezes_what_start_up_made_and_collects_young_objects_less_often() -> None:
    before = gc.get_threshold()
    start_up = [bytearray(8)]  # a list: tracked by the collector
    try:
        assert any(o is start_up for o in gc.get_objects())
        heap.settle()
        assert gc.get_threshold() == (heap.GEN0_THRESHOLD, 10, 10)
        assert heap.GEN0_THRESHOLD > before[0]
        assert gc.get_freeze_count() > 0
        assert not any(o is start_up for o in gc.get_objects())  # frozen: no collection sees it
        later = [bytearray(8)]
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
