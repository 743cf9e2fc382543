"""Served minus offline time to first token for one prompt, and where the difference goes.

    python -m kvfleet_engine.bench.ttft_hops --model DIR [--device cpu] [--prompt-len 512]

Starts `kvfleet serve` on the model (its own processes, as in production), sends `--requests`
streamed completions one after another (one prompt of `--prompt-len` random token ids each,
`--max-tokens` out), then reads `GET /debug/profile`: the server's mean first-token hops
(`core.profile.FIRST_TOKEN_HOPS`) and each process's phases over the requests. Then it runs the
same prompts offline (`LLM.generate`, one token) in this process. Prints a table; `--output`
writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvfleet_engine.argtypes import positive_int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.ttft_hops")
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default=None, help="engine device (default: the engine's)")
    parser.add_argument("--prompt-len", type=positive_int, default=512)
    parser.add_argument("--max-tokens", type=positive_int, default=16)
    parser.add_argument("--requests", type=positive_int, default=20)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--token-range", default="1000:119999", help="LOW:HIGH prompt ids")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra serve flag")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    low, high = (int(x) for x in args.token_range.split(":"))
    rnd = random.Random(11)
    prompts = [
        [rnd.randrange(low, high) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    engine_flags = ["--max-model-len", str(max(args.prompt_len + args.max_tokens, 1024))]
    if args.device:
        engine_flags += ["--device", args.device]
    served = _served(args, prompts, engine_flags)
    offline = _offline(args, prompts)
    result = {"served": served, "offline": offline}
    result["served_minus_offline_ms"] = round(served["ttft_ms_p50"] - offline["ttft_ms_p50"], 2)
    _print(result)
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))
    return 0


def _served(args: argparse.Namespace, prompts: list[list[int]], flags: list[str]) -> Any:
    import httpx

    from kvfleet_engine.bench.profile_split import fetch, split_of

    command = [
        sys.executable,
        "-m",
        "kvfleet_cli.main",
        "serve",
        "--model",
        args.model,
        "--served-model-name",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--log-level",
        "warning",
        *flags,
        *args.serve_arg,
    ]
    server = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{args.port}"
    try:
        _wait_ready(url, server)
        with httpx.Client(timeout=120) as client:
            for prompt in prompts[:2]:  # warm-up: first-call costs on both sides
                _stream_ttft(client, url, prompt, args.max_tokens)
            before = fetch(url)
            ttfts = [_stream_ttft(client, url, p, args.max_tokens) for p in prompts]
            after = fetch(url)
    finally:
        server.terminate()
        server.wait(30)
    return {
        "ttft_ms_p50": round(statistics.median(ttfts) * 1e3, 2),
        "ttft_ms_min": round(min(ttfts) * 1e3, 2),
        **split_of(before, after),
    }


def _offline(args: argparse.Namespace, prompts: list[list[int]]) -> Any:
    from kvfleet_engine import LLM, SamplingParams

    kwargs: dict[str, Any] = {"max_model_len": max(args.prompt_len + args.max_tokens, 1024)}
    if args.device:
        kwargs["device"] = args.device
    llm = LLM(model=args.model, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params, use_tqdm=False)
    times = []
    for prompt in prompts:
        llm.engine.kv_cache.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return {
        "ttft_ms_p50": round(statistics.median(times) * 1e3, 2),
        "ttft_ms_min": round(min(times) * 1e3, 2),
    }


def _stream_ttft(client: Any, url: str, prompt: list[int], max_tokens: int) -> float:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    assert first is not None, "no chunk came back"
    return first - start


def _wait_ready(url: str, server: subprocess.Popen[bytes]) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"kvfleet serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready")


def _print(result: dict[str, Any]) -> None:
    from kvfleet_engine.bench.profile_split import print_split

    served, offline = result["served"], result["offline"]
    print(
        f"TTFT p50: served {served['ttft_ms_p50']} ms, offline {offline['ttft_ms_p50']} ms, "
        f"difference {result['served_minus_offline_ms']} ms"
    )
    print_split({role: served[role] for role in ("api", "core")})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
