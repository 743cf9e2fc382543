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
Where the server exports kvfleet's (or vLLM's) Prometheus counters, the report adds what the
server counted during the load: the share of prompt tokens its prefix cache held (random
prompts of the same --seed repeat across loads, so a second load may compute far less), and
kvfleet's steps by kind.

At hundreds of streams one Python client process runs out of CPU before a fast server does:
`--client-processes N` splits the requests, the concurrency (or the request rate) over N
processes, each with its own event loop and connections. They send their first requests
together, once every process is ready, so the server meets the whole load at once as from one
client; the duration runs from that common start to the last process's end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from kvfleet_engine.argtypes import (
    api_key,
    api_key_or_environment,
    non_negative_float,
    positive_float,
    positive_int,
    seed,
)
from kvfleet_engine.bench.results import writable_file
from kvfleet_engine.bench.serve_counters import fetch_counters, format_counters, load_counters
from kvfleet_engine.bench.serve_load import (
    ClientProcessFailed,
    auth_headers,
    run_load,
    run_load_processes,
)
from kvfleet_engine.bench.serve_stats import format_report, summarize
from kvfleet_engine.bench.serve_workload import chat_requests, jsonl_requests, random_requests
from kvfleet_engine.server.auth import API_KEY_ENV

# --- CLI -------------------------------------------------------------------------------------


def _goodput(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    if name not in ("ttft", "tpot", "e2el") or not value:
        raise argparse.ArgumentTypeError(f"expected ttft:MS, tpot:MS or e2el:MS, got {text!r}")
    try:
        return name, positive_float(value)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{name}: {error} (milliseconds)") from None


def _base_url(text: str) -> str:
    """An http:// or https:// URL with a host."""
    try:
        host = httpx.URL(text).host if text.startswith(("http://", "https://")) else ""
    except httpx.InvalidURL:
        host = ""
    if not host:
        raise argparse.ArgumentTypeError(
            f"expected http://HOST[:PORT] or https://..., got {text!r}"
        )
    return text


def _readable_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"{'is a directory' if path.is_dir() else 'no such file'}: {text!r}"
        )
    return path


def _percentiles(text: str) -> list[float]:
    """ "50,90,99" -> [50.0, 90.0, 99.0], each in [0, 100]."""
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"expected P,P,... each in [0, 100], got {text!r}")
    return values


def _token_range(text: str) -> tuple[int, int]:
    """ "LOW:HIGH" -> (low, high) with 0 <= low <= high."""
    low, _, high = text.partition(":")
    try:
        bounds = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token ids, got {text!r}") from None
    if not 0 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW <= HIGH, got {text!r}")
    return bounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", type=_base_url, required=True, help="server base URL, e.g. http://localhost:8000"
    )
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
    # The dataset flags' defaults are _DATASET_FLAGS' (None here: given or not).
    parser.add_argument("--dataset-path", type=_readable_file, help="jsonl dataset file")
    parser.add_argument(
        "--chat-output-len",
        type=positive_int,
        help="max_tokens of each chat answer (default: 128)",
    )
    parser.add_argument("--random-input-len", type=positive_int, help="(default: 256)")
    parser.add_argument(
        "--random-output-len",
        type=positive_int,
        help="max_tokens of each random prompt, and of a jsonl prompt without its own "
        "output_len (default: 128)",
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        help="random prompt and output lengths drawn from len x [1 - R, 1 + R] (default 0: exact)",
    )
    parser.add_argument(
        "--random-prefix-len",
        type=int,
        help="the first N tokens of every random prompt are shared (prefix caching; default 0)",
    )
    parser.add_argument(
        "--random-token-range",
        type=_token_range,
        help="LOW:HIGH token ids for random prompts (default 3:250: fits every vocabulary)",
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="sampling temperature (0: greedy)",
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly the output length (kvfleet/vLLM extension)",
    )
    parser.add_argument("--goodput", type=_goodput, nargs="+", default=[], metavar="NAME:MS")
    parser.add_argument(
        "--percentiles", type=_percentiles, default="50,90,99", help="comma-separated, 0-100"
    )
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="per-request seconds")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument(
        "--client-processes",
        type=positive_int,
        default=1,
        help="client processes sharing the load (use several at hundreds of streams)",
    )
    parser.add_argument("--output", type=writable_file, help="write the JSON result here")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--api-key",
        type=api_key,
        help=f"bearer key sent with every request (default: ${API_KEY_ENV}); never recorded",
    )


# Flags only some datasets read -> (those datasets, the default). Given with another dataset, a
# flag would be ignored, so it is refused.
_DATASET_FLAGS: dict[str, tuple[tuple[str, ...], object]] = {
    "dataset_path": (("jsonl",), None),
    "chat_output_len": (("chat",), 128),
    "random_input_len": (("random",), 256),
    "random_output_len": (("random", "jsonl"), 128),
    "random_range_ratio": (("random",), 0.0),
    "random_prefix_len": (("random",), 0),
    "random_token_range": (("random",), (3, 250)),
}


def _dataset_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a dataset flag the chosen --dataset does not read; give the others' defaults."""
    for dest, (datasets, default) in _DATASET_FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif args.dataset not in datasets:
            parser.error(
                f"--{dest.replace('_', '-')} is read only with --dataset "
                f"{' or '.join(datasets)}, not --dataset {args.dataset}"
            )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfleet bench serve", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.api_key = api_key_or_environment(parser, args.api_key, API_KEY_ENV)
    _dataset_flags(parser, args)
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
        model = args.model or _first_model(args.url, auth_headers(args.api_key))
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
                args.random_token_range,
                args.seed,
                args.random_prefix_len,
            )
    except httpx.HTTPError as exc:
        print(f"kvfleet bench serve: error: --url {args.url}: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"kvfleet bench serve: error: {exc}", file=sys.stderr)
        return 2

    from tqdm import tqdm

    before = fetch_counters(args.url)
    with tqdm(total=len(requests), desc="requests", unit="req", disable=args.no_progress) as bar:
        spread = None
        if args.client_processes > 1:
            try:
                results, duration, spread = run_load_processes(args, model, requests, bar)
            except ClientProcessFailed as exc:
                print(f"kvfleet bench serve: error: {exc}", file=sys.stderr)
                return 1
        else:
            results, duration = asyncio.run(run_load(args, model, requests, bar))
    after = fetch_counters(args.url) if before is not None else None
    summary = summarize(results, duration, args.percentiles, dict(args.goodput))
    summary["client_start_spread_ms"] = None if spread is None else spread * 1e3
    summary["server"] = load_counters(before, after) if before and after else None
    print(format_report(summary))
    if summary["server"]:
        print("\n".join(format_counters(summary["server"])))
    if args.output:
        record = {
            "command": "kvfleet bench serve " + " ".join(_without_key(argv)),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": model,
            "config": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if k != "api_key"
            },
            "results": summary,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.output}")
    return 0 if summary["completed"] else 1


def _first_model(url: str, headers: dict[str, str]) -> str:
    response = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    data = response.json()["data"]
    if not data:
        raise ValueError(f"{url} serves no models")
    return str(data[0]["id"])


def _without_key(argv: list[str]) -> list[str]:
    """The command line with --api-key's value masked."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("***")
        elif arg.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(arg)
        hide = arg == "--api-key"
    return out
