"""Prefix-aware against round-robin routing on the same real engines, in one run.

    python bench/router_prefix.py [--engines 3] [--tenants 12] [--system-chars 3200]
        [--users 6] [--turns 3] [--concurrency 6] [--routers 1]
        [--strategies round-robin prefix] [--out bench/results/router-prefix.json]

Starts `--engines` CPU engines (`kvfleet serve --device cpu`, one thread each; SmolLM2 by
default, `--model` for another) and two routers in front of all of them, `--strategy prefix`
and `--strategy round-robin`. Then the same multi-tenant chat workload runs through each router
in turn (round-robin first): `--tenants` system prompts of `--system-chars` characters (about
4 characters per SmolLM2 token), `--users` users per tenant, each a conversation of `--turns`
turns, `--concurrency` conversations at a time, streamed, 16 tokens per answer. The two phases
use different tenant texts, so the first leaves nothing cached that helps the second.

Per phase: TTFT p50/p90 (client side, to the first content chunk), requests/s, the engines'
prefix-cache hit rate (kvfleet_prefix_cache_hits / queries, summed over the engines, for the
phase) and the ideal hit rate of the workload: each request could at best reuse the previous
turn's whole prompt (later turns) or its tenant's system prompt (first turns of later users),
in full 16-token blocks; shared characters are turned into tokens at the request's own
tokens-per-character ratio (usage.prompt_tokens / rendered characters).

`--routers N` starts N router processes per strategy, and every request goes to one of them at
random (as a Service spreads connections over router pods), so a conversation's turns reach
different routers, each of which learns only what it routed. `--strategies` picks the phases.
ROUTER_TREE=DIR runs the routers from DIR/operator (an older tree, `git archive REV operator`),
the engines and the client from this one: an A/B of the router alone.

Targets (issue 17): prefix TTFT p90 at least 3x lower than round-robin; prefix hit rate within
10% of the ideal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

WORDS = (
    "account answer balance border branch budget call care case chance change charge choice "
    "claim client code cost credit data date deal delay demand detail device doctor driver "
    "effort energy error event fact factor field figure file form fund goal group growth guide "
    "issue item job key level limit line link list loan market matter meaning measure member "
    "method model moment money month name need network number offer order owner page part "
    "payment period person plan point policy price problem process product program project "
    "quality question range rate reason record region report request result review risk role "
    "rule sale scale season section service share side sign size skill source space staff "
    "stage standard start state step store story strategy structure study style subject "
    "supply support system table target task team term test thing time tool topic total trade "
    "training transfer trip truth type unit user value version view volume week window word"
).split()
BLOCK_TOKENS = 16
ANSWER_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def system_prompt(rng: random.Random, tenant: int, chars: int) -> str:
    words = [f"You are the support assistant of company {tenant}. Policies follow."]
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def conversations(seed: int, args: argparse.Namespace) -> list[tuple[int, str, list[str]]]:
    """(tenant, system prompt, user questions) per conversation, tenants interleaved."""
    rng = random.Random(seed)
    systems = [system_prompt(rng, t, args.system_chars) for t in range(args.tenants)]
    plan = []
    for user in range(args.users):
        for tenant in range(args.tenants):
            questions = [
                f"User {user}: question {turn} about {rng.choice(WORDS)} and {rng.choice(WORDS)}?"
                for turn in range(args.turns)
            ]
            plan.append((tenant, systems[tenant], questions))
    return plan


def canonical_chars(messages: list[dict[str, str]]) -> int:
    return sum(len(m["role"]) + len(m["content"]) + 2 for m in messages)


async def run_phase(
    urls: list[str], model: str, plan: list[tuple[int, str, list[str]]], concurrency: int,
    seed: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every conversation through the routers at `urls` (each request to one at random); one
    record per request."""
    pick = random.Random(seed)
    records: list[dict[str, Any]] = []
    queue: asyncio.Queue[tuple[int, int, str, list[str]]] = asyncio.Queue()
    for number, item in enumerate(plan):
        queue.put_nowait((number, *item))
    seen_tenants: set[int] = set()

    async def conversation(
        http: httpx.AsyncClient, number: int, tenant: int, system: str, qs: list[str]
    ):
        messages = [{"role": "system", "content": system}]
        first_of_tenant = tenant not in seen_tenants
        seen_tenants.add(tenant)
        previous_chars = 0
        for turn, question in enumerate(qs):
            shared = previous_chars if turn else (0 if first_of_tenant else len(system) + 8)
            messages.append({"role": "user", "content": question})
            body = {
                "model": model, "messages": messages, "max_tokens": ANSWER_TOKENS,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            }  # fmt: skip
            started = time.perf_counter()
            first = None
            text, usage, replica = [], None, None
            url = pick.choice(urls)
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                replica = response.headers.get("x-kvfleet-replica")
                if response.status_code != 200:
                    records.append({"ok": False, "status": response.status_code})
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            first = first or time.perf_counter()
                            text.append(piece)
            total_chars = canonical_chars(messages)
            prompt_tokens = usage["prompt_tokens"] if usage else None
            records.append(
                {
                    "ok": first is not None,
                    "ttft_s": None if first is None else first - started,
                    "e2e_s": time.perf_counter() - started,
                    "replica": replica,
                    "router": urls.index(url),
                    "conversation": number,
                    "tenant": tenant,
                    "turn": turn,
                    "prompt_tokens": prompt_tokens,
                    "ideal_cached_tokens": _ideal(prompt_tokens, shared, total_chars),
                }
            )
            messages.append({"role": "assistant", "content": "".join(text)})
            previous_chars = total_chars

    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as http:

        async def worker() -> None:
            while not queue.empty():
                await conversation(http, *queue.get_nowait())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def _ideal(prompt_tokens: int | None, shared_chars: int, total_chars: int) -> int | None:
    if prompt_tokens is None or total_chars == 0:
        return None
    tokens = prompt_tokens * shared_chars / total_chars
    return int(tokens // BLOCK_TOKENS) * BLOCK_TOKENS


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) summed over the engines."""
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kvfleet_prefix_cache_hits_total{"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("kvfleet_prefix_cache_queries_total{"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def wait_ready(url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(name: str, records: list[dict[str, Any]], hits: float, queries: float, wall: float):
    ok = [r for r in records if r["ok"]]
    ttfts = [r["ttft_s"] for r in ok]
    ideal = [r for r in ok if r["ideal_cached_tokens"] is not None]
    ideal_rate = sum(r["ideal_cached_tokens"] for r in ideal) / max(
        1, sum(r["prompt_tokens"] for r in ideal)
    )
    by_replica: dict[str, int] = {}
    for r in ok:
        by_replica[r["replica"]] = by_replica.get(r["replica"], 0) + 1
    homes: dict[int, set[str]] = {}
    for r in ok:
        homes.setdefault(r["conversation"], set()).add(r["replica"])
    return {
        "strategy": name,
        "conversations_on_one_replica": sum(len(h) == 1 for h in homes.values()) / len(homes)
        if homes
        else None,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p90_s": pct(ttfts, 0.9) if ttfts else None,
        "requests_per_s": len(ok) / wall,
        "prefix_hit_rate": hits / queries if queries else None,
        "ideal_hit_rate": ideal_rate,
        "requests_by_replica": by_replica,
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--system-chars", type=int, default=3200)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--kv-cache-blocks", type=int, default=320, help="per engine")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--routers", type=int, default=1, help="router processes per strategy")
    parser.add_argument(
        "--strategies", nargs="+", default=["round-robin", "prefix"],
        choices=["round-robin", "prefix", "least-load"],
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model
    if model is None:
        model = subprocess.run(
            [sys.executable, "-m", "kvfleet_cli", "fetch-model", "--print-path"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    served = "bench"
    logs = Path(os.environ.get("BENCH_LOGS", "/tmp/kvfleet-router-bench"))
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    engine_urls: list[str] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        for i in range(args.engines):
            port = free_port()
            engine_urls.append(f"http://127.0.0.1:{port}")
            command = [
                sys.executable, "-m", "kvfleet_cli", "serve", "--model", model,
                "--served-model-name", served, "--device", "cpu", "--host", "127.0.0.1",
                "--port", str(port), "--kv-cache-blocks", str(args.kv_cache_blocks),
                "--max-model-len", str(args.max_model_len), "--max-num-seqs", "8",
                "--max-num-batched-tokens", "512",
            ]  # fmt: skip
            with (logs / f"engine-{i}.log").open("wb") as log:
                procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
        routers: dict[str, list[str]] = {}
        tree = os.environ.get("ROUTER_TREE")
        router_env = (
            {**os.environ, "PYTHONPATH": str(Path(tree, "operator").resolve())} if tree else None
        )
        for strategy in args.strategies:
            for n in range(args.routers):
                port = free_port()
                backends = [a for url in engine_urls for a in ("--backend", url)]
                command = [
                    sys.executable, "-m", "kvfleet_cli", "router", *backends, "--strategy",
                    strategy, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                ]  # fmt: skip
                with (logs / f"router-{strategy}-{n}.log").open("wb") as log:
                    procs.append(subprocess.Popen(command, stdout=log, stderr=log, env=router_env))
                routers.setdefault(strategy, []).append(f"http://127.0.0.1:{port}")
        for url in engine_urls:
            wait_ready(url + "/ready", 600)
        for url in [u for urls in routers.values() for u in urls]:
            wait_ready(url + "/ready", 60)
        time.sleep(1.0)  # first scrapes: every engine available in both routers

        results = []
        for seed, (strategy, urls) in enumerate(routers.items(), start=1):
            plan = conversations(seed, args)
            hits0, queries0 = prefix_counters(engine_urls)
            started = time.perf_counter()
            records = asyncio.run(run_phase(urls, served, plan, args.concurrency, seed))
            wall = time.perf_counter() - started
            hits1, queries1 = prefix_counters(engine_urls)
            summary = summarize(strategy, records, hits1 - hits0, queries1 - queries0, wall)
            results.append(summary)
            print(f"{strategy}: {json.dumps(summary)}", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    print(f"\n{'strategy':<12} {'hit rate':>9} {'ideal':>7} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'req/s':>7} {'one home':>9}")  # fmt: skip
    for r in results:
        rates = f"{r['prefix_hit_rate']:>9.3f} {r['ideal_hit_rate']:>7.3f}"
        ttfts = f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p90_s']:>8.3f}s"
        homes = f"{r['conversations_on_one_replica']:>9.2f}"
        print(f"{r['strategy']:<12} {rates} {ttfts} {r['requests_per_s']:>7.2f} {homes}")
    by_name = {r["strategy"]: r for r in results}
    ratio = None
    if "round-robin" in by_name and "prefix" in by_name:
        ratio = by_name["round-robin"]["ttft_p90_s"] / by_name["prefix"]["ttft_p90_s"]
        print(f"TTFT p90 round-robin / prefix = {ratio:.2f} (target >= 3)")
    if args.out is not None:
        out = {
            "bench": "router-prefix",
            "command": "python bench/router_prefix.py " + " ".join(sys.argv[1:]),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "model": model,
            "settings": vars(args) | {"out": str(args.out), "model": model},
            "router_tree": os.environ.get("ROUTER_TREE"),
            "results": results,
            "ttft_p90_ratio_round_robin_over_prefix": ratio,
            "targets": {"ttft_p90_ratio": 3.0, "hit_rate_of_ideal": 0.9},
        }
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
