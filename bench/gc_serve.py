"""`kvfleet serve` with the API process's young-generation GC threshold set: bench/cpu_gc_probe.sh
runs it at CPython's 700 and at `core.heap.GEN0_THRESHOLD` (the engine core, a process of its
own, keeps the engine's).
Usage: python bench/gc_serve.py GEN0_THRESHOLD [kvfleet serve flags...]"""

import sys


def main() -> int:
    from kvfleet_engine.core import heap
    from kvfleet_engine.server.cli import main as serve

    heap.GEN0_THRESHOLD = int(sys.argv[1])
    return serve(sys.argv[2:])


if __name__ == "__main__":  # the engine core is spawned: it imports this file again
    sys.exit(main())
