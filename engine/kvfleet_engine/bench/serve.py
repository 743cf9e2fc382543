"""`kvfleet bench serve`: load an OpenAI-compatible server and report latency and throughput.

    kvfleet bench serve --url http://localhost:8000 --request-rate 8 --num-prompts 200 \\
        --dataset random --random-input-len 512 --random-output-len 128 --output result.json
    kvfleet bench serve --url http://localhost:8000 --concurrency 8 --num-prompts 64 \\
        --dataset chat --chat-output-len 64 --no-ignore-eos

Datasets: `random` (token ids of exact lengths), `jsonl` (your prompts), `chat` (built-in English
questions, each sent as a user message to /v1/chat/completions).

Every request streams, so TTFT (request sent -> first token), ITL (gaps between streamed
tokens), TPOT ((e2e - TTFT) / (output tokens - 1)) and end-to-end latency are measured per
request and reported at the chosen percentiles, with request and token throughput and goodput
(requests per second that met every given SLO). Works against any OpenAI-compatible server.

At hundreds of streams one Python client process runs out of CPU before a fast server does:
`--client-processes N` splits the requests, the concurrency (or the request rate) over N
processes, each with its own event loop and connections; the duration runs from the first
process's start to the last one's end.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import multiprocessing
import queue
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvfleet_engine.argtypes import positive_float, positive_int
from kvfleet_engine.bench.chat import QUESTIONS

# --- workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (random dataset: exact input lengths)
    num_prompt_tokens: int  # input length as the dataset knows it (0 if unknown)
    max_tokens: int  # output length asked for


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    token_range: tuple[int, int],
    seed: int,
    prefix_len: int = 0,
) -> list[BenchRequest]:
    """Prompts of random token ids; lengths uniform in [len*(1-ratio), len*(1+ratio)]. The first
    `prefix_len` tokens of every prompt are the same (a shared system prompt, say)."""
    rng = random.Random(seed)
    low, high = token_range
    prefix = [rng.randint(low, high) for _ in range(prefix_len)]

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        n_in = max(length(input_len), prefix_len + 1)
        ids = prefix + [rng.randint(low, high) for _ in range(n_in - prefix_len)]
        requests.append(BenchRequest(ids, n_in, length(output_len)))
    return requests


def jsonl_requests(path: Path, num: int, default_output_len: int) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": str, "output_len": int (optional)}."""
    requests = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: expected {{'prompt': ...}}: {exc}") from exc
            requests.append(BenchRequest(prompt, 0, int(row.get("output_len", default_output_len))))
            if len(requests) == num:
                break
    if not requests:
        raise ValueError(f"{path}: no prompts found")
    return requests


def chat_requests(num: int, output_len: int) -> list[BenchRequest]:
    """The built-in chat questions in turn, each answered in at most `output_len` tokens."""
    return [BenchRequest(QUESTIONS[i % len(QUESTIONS)], 0, output_len) for i in range(num)]


# --- one request -------------------------------------------------------------------------------


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


async def run_load(
    args: argparse.Namespace, model: str, requests: list[BenchRequest], progress: Any
) -> tuple[list[RequestResult], float]:
    extra: dict[str, Any] = {"temperature": args.temperature}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    results: list[RequestResult] = [RequestResult() for _ in requests]
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def one(i: int) -> None:
            results[i] = await send_request(
                client, args.url, model, args.endpoint, requests[i], extra
            )
            progress.update(1)

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


def _client_process(
    k: int,
    args: argparse.Namespace,
    model: str,
    requests: list[BenchRequest],
    counter: Any,
    results: Any,
) -> None:
    start = time.perf_counter()
    share, _ = asyncio.run(run_load(args, model, requests, _SharedProgress(counter)))
    results.put((k, share, start, time.perf_counter()))


def run_load_processes(
    args: argparse.Namespace, model: str, requests: list[BenchRequest], progress: Any
) -> tuple[list[RequestResult], float]:
    """`run_load` split over args.client_processes processes: request i goes to process
    i % N; the concurrency or the rate is divided among them."""
    num = min(args.client_processes, len(requests), args.concurrency or len(requests))
    context = multiprocessing.get_context("spawn")
    counter = context.Value("i", 0)
    results_queue = context.Queue()
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
            args=(k, share_args, model, share, counter, results_queue),
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
            failed = [p.name for p in processes if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"client process(es) {failed} failed") from None
        progress.update(counter.value - progress.n)
    for process in processes:
        process.join()
    results: list[RequestResult] = [RequestResult() for _ in requests]
    for k, (share_results, _, _) in shares.items():
        results[k::num] = share_results
    duration = max(end for _, _, end in shares.values()) - min(s for _, s, _ in shares.values())
    return results, duration


# --- report --------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    results: list[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    slos_ms: dict[str, float],
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.num_prompt_tokens for r in ok)
    total_out = sum(r.num_output_tokens for r in ok)
    series_ms = {
        "ttft": [r.ttft_s * 1e3 for r in ok],
        "tpot": [t * 1e3 for r in ok if (t := r.tpot_s) is not None],
        "itl": [gap * 1e3 for r in ok for gap in r.itls_s],
        "e2el": [r.e2e_s * 1e3 for r in ok],
    }
    latency: dict[str, dict[str, float]] = {}
    for name, values in series_ms.items():
        stats = {"mean": sum(values) / len(values) if values else math.nan}
        stats.update({f"p{p:g}": percentile(values, p) for p in percentiles})
        latency[f"{name}_ms"] = stats

    def meets(r: RequestResult) -> bool:
        measured = {"ttft": r.ttft_s * 1e3, "e2el": r.e2e_s * 1e3}
        if r.tpot_s is not None:
            measured["tpot"] = r.tpot_s * 1e3
        return all(measured.get(k, 0.0) <= v for k, v in slos_ms.items())

    errors = Counter(r.error[:120] for r in results if not r.success)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s if duration_s else math.nan,
        "output_token_throughput": total_out / duration_s if duration_s else math.nan,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s else math.nan,
        "goodput_slos_ms": slos_ms,
        "request_goodput": (
            sum(1 for r in ok if meets(r)) / duration_s if slos_ms and duration_s else None
        ),
        **latency,
    }


def format_report(summary: dict[str, Any]) -> str:
    lines = [
        f"{'requests completed / failed':<34}{summary['completed']} / {summary['failed']}",
        f"{'duration (s)':<34}{summary['duration_s']:.2f}",
        f"{'input / output tokens':<34}{summary['total_input_tokens']} / "
        f"{summary['total_output_tokens']}",
        f"{'request throughput (req/s)':<34}{summary['request_throughput']:.2f}",
        f"{'output token throughput (tok/s)':<34}{summary['output_token_throughput']:.1f}",
        f"{'total token throughput (tok/s)':<34}{summary['total_token_throughput']:.1f}",
    ]
    if summary["request_goodput"] is not None:
        lines.append(f"{'request goodput (req/s)':<34}{summary['request_goodput']:.2f}")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = summary[name]
        cells = "  ".join(f"{k} {v:.2f}" for k, v in stats.items())
        lines.append(f"{name:<34}{cells}")
    for error, count in summary["errors"].items():
        lines.append(f"error ×{count}: {error}")
    return "\n".join(lines)


# --- CLI -------------------------------------------------------------------------------------


def _goodput(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    if name not in ("ttft", "tpot", "e2el") or not value:
        raise argparse.ArgumentTypeError(f"expected ttft:MS, tpot:MS or e2el:MS, got {text!r}")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: expected milliseconds, got {value!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://localhost:8000")
    parser.add_argument("--model", help="model name to send (default: the server's first model)")
    parser.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        help="/v1/completions or /v1/chat/completions (default: chat for --dataset chat, else "
        "completions)",
    )
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument(
        "--request-rate",
        type=positive_float,
        help="requests per second (Poisson); inf: all at once",
    )
    load.add_argument("--concurrency", type=positive_int, help="requests kept in flight")
    parser.add_argument("--num-prompts", type=positive_int, default=100)
    parser.add_argument(
        "--dataset",
        choices=["random", "jsonl", "chat"],
        default="random",
        help="random token ids, a jsonl file of prompts, or built-in chat questions",
    )
    parser.add_argument("--dataset-path", type=Path, help="jsonl dataset file")
    parser.add_argument(
        "--chat-output-len", type=positive_int, default=128, help="max_tokens of each chat answer"
    )
    parser.add_argument("--random-input-len", type=positive_int, default=256)
    parser.add_argument("--random-output-len", type=positive_int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="the first N tokens of every random prompt are shared (prefix caching)",
    )
    parser.add_argument(
        "--random-token-range",
        default="3:250",
        help="LOW:HIGH token ids for random prompts (fits every vocabulary by default)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly the output length (kvfleet/vLLM extension)",
    )
    parser.add_argument("--goodput", type=_goodput, nargs="+", default=[], metavar="NAME:MS")
    parser.add_argument("--percentiles", default="50,90,99", help="comma-separated")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--client-processes",
        type=positive_int,
        default=1,
        help="client processes sharing the load (use several at hundreds of streams)",
    )
    parser.add_argument("--output", type=Path, help="write the JSON result here")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfleet bench serve", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        low, high = (int(x) for x in args.random_token_range.split(":"))
        percentiles = [float(p) for p in args.percentiles.split(",")]
    except ValueError:
        parser.error("--random-token-range LOW:HIGH and --percentiles P,P,... take numbers")
    if not 0 <= args.random_range_ratio < 1:
        parser.error("--random-range-ratio: must be in [0, 1)")
    if not 0 <= args.random_prefix_len < args.random_input_len:
        parser.error("--random-prefix-len: must be in [0, --random-input-len)")
    if args.dataset == "jsonl" and args.dataset_path is None:
        parser.error("--dataset jsonl needs --dataset-path")
    if args.dataset == "chat" and args.endpoint == "completions":
        parser.error("--dataset chat sends messages: --endpoint chat (or leave it out)")
    if args.endpoint is None:
        args.endpoint = "chat" if args.dataset == "chat" else "completions"
    try:
        model = args.model or _first_model(args.url)
        if args.dataset == "jsonl":
            requests = jsonl_requests(args.dataset_path, args.num_prompts, args.random_output_len)
        elif args.dataset == "chat":
            requests = chat_requests(args.num_prompts, args.chat_output_len)
        else:
            requests = random_requests(
                args.num_prompts,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                (low, high),
                args.seed,
                args.random_prefix_len,
            )
    except (httpx.HTTPError, ValueError, OSError) as exc:
        print(f"kvfleet bench serve: {exc}", file=sys.stderr)
        return 2

    from tqdm import tqdm

    with tqdm(total=len(requests), desc="requests", unit="req", disable=args.no_progress) as bar:
        if args.client_processes > 1:
            results, duration = run_load_processes(args, model, requests, bar)
        else:
            results, duration = asyncio.run(run_load(args, model, requests, bar))
    summary = summarize(results, duration, percentiles, dict(args.goodput))
    print(format_report(summary))
    if args.output:
        record = {
            "command": "kvfleet bench serve " + " ".join(argv),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": model,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": summary,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.output}")
    return 0 if summary["completed"] else 1


def _first_model(url: str) -> str:
    response = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
    response.raise_for_status()
    data = response.json()["data"]
    if not data:
        raise ValueError(f"{url} serves no models")
    return str(data[0]["id"])
