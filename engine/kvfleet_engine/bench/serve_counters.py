"""What the server itself counted during a `kvfleet bench serve` load: its Prometheus counters
read before and after, so a report says how much of the load the prefix cache served (a load
whose prompts an earlier load already sent computes far less) and what kind of steps ran.

Reads kvfleet's names, or vLLM's where the server is vLLM; a server without /metrics, or
without those counters, gives no record (the load's own figures stand alone).
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_engine.outputs import STEP_KINDS

# Our name, then the vLLM name of the same counter (None: vLLM has none).
_COUNTERS = {
    "prompt_tokens": ("kvfleet_prompt_tokens", "vllm:prompt_tokens"),
    "prefix_cache_queries": ("kvfleet_prefix_cache_queries", "vllm:prefix_cache_queries"),
    "prefix_cache_hits": ("kvfleet_prefix_cache_hits", "vllm:prefix_cache_hits"),
    "preemptions": ("kvfleet_preemptions", "vllm:num_preemptions"),
}
_STEPS = "kvfleet_engine_steps"


def read_counters(text: str) -> dict[str, float]:
    """Counter totals from a /metrics body: {name: value}, summed over label sets (several
    models or ranks), and steps as `steps_<kind>`; absent counters are absent."""
    totals: dict[str, float] = {}
    by_family: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if family.name == _STEPS and sample.labels.get("kind") in STEP_KINDS:
                key = f"steps_{sample.labels['kind']}"
                totals[key] = totals.get(key, 0.0) + sample.value
            else:
                by_family[family.name] = by_family.get(family.name, 0.0) + sample.value
    for key, names in _COUNTERS.items():
        found = [by_family[name] for name in names if name in by_family]
        if found:
            totals[key] = found[0]
    return totals


def load_counters(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """The load's share of the counters, with the fraction of prompt tokens the prefix cache
    held (None when the server does not count cache lookups)."""
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    if "prefix_cache_queries" not in delta:
        return None
    queries = delta["prefix_cache_queries"]
    record: dict[str, Any] = {key: int(value) for key, value in sorted(delta.items())}
    record["prefix_cache_hit_ratio"] = (
        delta.get("prefix_cache_hits", 0.0) / queries if queries else 0.0
    )
    return record


def fetch_counters(url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """GET {url}/metrics and read its counters; None when there is no such endpoint."""
    try:
        response = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return read_counters(response.text)
    except ValueError:  # not Prometheus text
        return None


def format_counters(record: dict[str, Any]) -> list[str]:
    steps = "  ".join(f"{kind} {record.get(f'steps_{kind}', 0)}" for kind in STEP_KINDS)
    lines = [
        f"{'server: prompt tokens from cache':<34}{record['prefix_cache_hit_ratio']:.1%} "
        f"({record.get('prefix_cache_hits', 0)} of {record['prefix_cache_queries']})",
    ]
    if any(f"steps_{kind}" in record for kind in STEP_KINDS):
        lines.append(f"{'server: engine steps':<34}{steps}")
    if "preemptions" in record:
        lines.append(f"{'server: preemptions':<34}{record['preemptions']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """`python -m kvfleet_engine.bench.serve_counters --url URL [--label L] -- CMD ...`: run a
    load generator (any: the shared client, `kvfleet bench serve`) and print, after its own
    output, one JSON line of what the server counted while it ran."""
    import argparse
    import json

    from kvfleet_engine.bench import around_load

    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.serve_counters")
    around_load.add_arguments(parser)
    args = parser.parse_args(argv)
    command = around_load.load_command(parser, args)
    before = fetch_counters(args.url)
    code = around_load.run(command)
    after = fetch_counters(args.url)
    record = load_counters(before, after) if before and after else None
    print(json.dumps({"label": args.label, "server": record}), flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
