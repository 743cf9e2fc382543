"""`kvfleet bench <benchmark> [args]`: dispatch to one benchmark module, imported lazily."""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help). The function takes argv and returns an exit code.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": ("kvfleet_engine.bench.serve:main", "load an OpenAI-compatible server"),
    "throughput": ("kvfleet_engine.bench.offline:throughput", "offline batch generation speed"),
    "latency": ("kvfleet_engine.bench.offline:latency", "batch-1 decode speed"),
    "chat": ("kvfleet_engine.bench.chat:main", "a real model's chats, kvfleet vs transformers"),
    "accuracy": (
        "kvfleet_engine.bench.accuracy:main",
        "perplexity and greedy agreement of configs (quantizations, KV dtypes) vs a baseline",
    ),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        width = max(len(name) for name in BENCHMARKS)
        print("usage: kvfleet bench <benchmark> [args...]\n\nbenchmarks:")
        for name, (_, help_) in BENCHMARKS.items():
            print(f"  {name:<{width}}  {help_}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(
            f"kvfleet bench: unknown benchmark {name!r}; one of {sorted(BENCHMARKS)}",
            file=sys.stderr,
        )
        return 2
    module_name, func_name = BENCHMARKS[name][0].split(":")
    code: int = getattr(importlib.import_module(module_name), func_name)(rest)
    return code
