"""`kvfleet bench serve` load: one streamed request timed, and the load run in one or several client
processes (concurrency or request rate)."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import multiprocessing
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvfleet_engine.bench.serve_workload import BenchRequest


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    num_prompt_tokens: int = 0  # from the server's usage when it sends one
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    endpoint: str,
    request: BenchRequest,
    extra: dict[str, Any],
) -> RequestResult:
    result = RequestResult(num_prompt_tokens=request.num_prompt_tokens)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if endpoint == "chat":
        text = (
            request.prompt
            if isinstance(request.prompt, str)
            else " ".join(map(str, request.prompt))
        )
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = request.prompt
        path = "/v1/completions"
    start = time.perf_counter()
    last = start
    num_chunks = 0
    try:
        async with client.stream("POST", url.rstrip("/") + path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                usage = chunk.get("usage")
                if usage:
                    result.num_output_tokens = usage.get("completion_tokens", 0)
                    result.num_prompt_tokens = usage.get("prompt_tokens", result.num_prompt_tokens)
                if not _has_content(chunk):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                last = now
                num_chunks += 1
        result.e2e_s = time.perf_counter() - start
        if not result.num_output_tokens:
            result.num_output_tokens = num_chunks
        result.success = num_chunks > 0
        if not result.success:
            result.error = "no tokens received"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _has_content(chunk: dict[str, Any]) -> bool:
    """A chunk that carries generated tokens (its text may be empty: a partial character, or
    ids a random-weight model's tokenizer cannot spell); not chat's opening role-only chunk."""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            return True
        delta = choice.get("delta") or {}
        if "role" not in delta and ("content" in delta or choice.get("finish_reason")):
            return True
    return False


# --- load ----------------------------------------------------------------------------------


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header for a server started with an API key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def run_load(
    args: argparse.Namespace,
    model: str,
    requests: list[BenchRequest],
    progress: Any,
    ready: Callable[[], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send the requests (a concurrency's worth in flight, or at a request rate) and return
    their results and the load's duration. `ready`, if given, is called once everything is set
    up, just before the first request goes out (the client processes' common start)."""
    extra: dict[str, Any] = {"temperature": args.temperature}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    results: list[RequestResult] = [RequestResult() for _ in requests]
    headers = auth_headers(args.api_key)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:

        async def one(i: int) -> None:
            results[i] = await send_request(
                client, args.url, model, args.endpoint, requests[i], extra
            )
            progress.update(1)

        if ready is not None:
            ready()
        start = time.perf_counter()
        if args.concurrency is not None:
            next_index = iter(range(len(requests)))

            async def worker() -> None:
                for i in next_index:
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        else:
            rng = random.Random(args.seed)
            tasks = []
            for i in range(len(requests)):
                tasks.append(asyncio.create_task(one(i)))
                if math.isfinite(args.request_rate):
                    await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


class _SharedProgress:
    """A client process's progress bar: a counter the parent process reads."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter

    def update(self, n: int) -> None:
        with self.counter.get_lock():
            self.counter.value += n


class ClientProcessFailed(RuntimeError):
    """A client process of `run_load_processes` exited with an error; the others were stopped."""


# How long a client process waits at the start for the others (their interpreters start and
# import this module: seconds on a busy host).
_START_TIMEOUT_S = 300.0


def _client_process(
    k: int,
    args: argparse.Namespace,
    model: str,
    requests: list[BenchRequest],
    counter: Any,
    results: Any,
    barrier: threading.Barrier,
) -> None:
    started: list[float] = []

    def ready() -> None:
        try:
            barrier.wait(timeout=_START_TIMEOUT_S)
        except threading.BrokenBarrierError:  # another process failed, or never got ready
            name = multiprocessing.current_process().name
            raise SystemExit(f"{name}: the other client processes did not start") from None
        started.append(time.perf_counter())

    progress = _SharedProgress(counter)
    share, duration = asyncio.run(run_load(args, model, requests, progress, ready))
    results.put((k, share, started[0], started[0] + duration))


def run_load_processes(
    args: argparse.Namespace, model: str, requests: list[BenchRequest], progress: Any
) -> tuple[list[RequestResult], float, float]:
    """`run_load` split over args.client_processes processes: request i goes to process
    i % N; the concurrency or the rate is divided among them. The processes send their first
    requests together, once every one of them is ready (a fresh interpreter takes a second to
    start on a busy host, and a process that started early would otherwise meet an idle server
    while the others are still importing). Returns the results, the duration from that common
    start to the last process's end, and how far apart the processes' starts were (seconds)."""
    num = min(args.client_processes, len(requests), args.concurrency or len(requests))
    context = multiprocessing.get_context("spawn")
    counter = context.Value("i", 0)
    results_queue = context.Queue()
    barrier = context.Barrier(num)
    processes = []
    for k in range(num):
        share_args = copy.copy(args)
        if args.concurrency is not None:
            share_args.concurrency = args.concurrency // num + (k < args.concurrency % num)
        else:
            share_args.request_rate = args.request_rate / num
            share_args.seed = args.seed + k
        share = requests[k::num]
        process = context.Process(
            target=_client_process,
            args=(k, share_args, model, share, counter, results_queue, barrier),
            name=f"bench-client-{k}",
        )
        process.start()
        processes.append(process)
    shares: dict[int, tuple[list[RequestResult], float, float]] = {}
    while len(shares) < num:
        try:
            k, share_results, start, end = results_queue.get(timeout=0.2)
            shares[k] = (share_results, start, end)
        except queue.Empty:
            failed = [f"{p.name} exit code {p.exitcode}" for p in processes if p.exitcode]
            if failed:
                barrier.abort()  # the others stop waiting for it
                for process in processes:
                    process.terminate()
                raise ClientProcessFailed(f"{', '.join(failed)}; its error is above") from None
        progress.update(counter.value - progress.n)
    for process in processes:
        process.join()
    results: list[RequestResult] = [RequestResult() for _ in requests]
    for k, (share_results, _, _) in shares.items():
        results[k::num] = share_results
    starts = [start for _, start, _ in shares.values()]
    duration = max(end for _, _, end in shares.values()) - min(starts)
    return results, duration, max(starts) - min(starts)
