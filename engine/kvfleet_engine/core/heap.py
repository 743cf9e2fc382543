"""How a serving process's garbage collector runs once it has started (the API process and the
engine core alike): the start-up objects (model, tokenizer, app, imports) frozen out of every
collection, and the youngest generation collected every GEN0_THRESHOLD allocations instead of
CPython's 700.

A stream's objects (outputs, chunks, messages) die within a step by reference counting; at 700
allocations the collector catches them alive, promotes them, and every so often walks the whole
heap of in-flight requests. On the CPU with the tiny model at 1,024 streams (bench/cpu_gc_probe.sh,
`bench/results/2026-12-06-cpu-gc-thresholds-c1024.json`, two rounds), the API process paused
5.4-5.7 s of a ~40 s load in collections, 18 of them full ones of ~215 ms with every stream
stalled, TPOT p99 218-244 ms; at 20,000: 0.8-1.1 s, none full (three middle ones of ~200 ms),
TPOT p99 153-163 ms.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000
GEN1_THRESHOLD = 10  # young collections per middle one (CPython's)
GEN2_THRESHOLD = 10  # middle collections per full one, when the heap grew by 25% (CPython's)


def settle() -> None:
    """Call once start-up is done: collect, freeze what survived, collect less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
