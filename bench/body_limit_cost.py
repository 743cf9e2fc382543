"""What the engine's body middleware (`server/body_limit.py`) costs a request, against an
earlier version of the same file: one 2 kB Content-Length body per request through the
middleware alone (a stub app), 50,000 requests a round, three alternating rounds, on the CPU.

    git show 14626e6:engine/kvfleet_engine/server/body_limit.py > /tmp/body_limit_old.py
    .venv/bin/python bench/body_limit_cost.py /tmp/body_limit_old.py --output cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import time
from typing import Any

from kvfleet_engine.server import body_limit

BODY = json.dumps({"model": "m", "prompt": "x" * 2000, "max_tokens": 16}).encode()
SCOPE = {
    "type": "http",
    "headers": [(b"content-length", str(len(BODY)).encode())],
    "client": ("10.0.0.1", 40000),
}
REQUESTS, ROUNDS = 50_000, 3


async def app(scope: Any, receive: Any, send: Any) -> None:
    await receive()


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": BODY, "more_body": False}


async def send(message: Any) -> None:
    pass


def middleware(module: Any) -> Any:
    """The module's BodyLimit with the engine's defaults (older ones take no timeout)."""
    params = inspect.signature(module.BodyLimit).parameters
    timeout = {"idle_timeout_s": 60.0} if "idle_timeout_s" in params else {}
    return module.BodyLimit(app, module.DEFAULT_MAX_REQUEST_BODY_BYTES, **timeout)


async def us_per_request(layer: Any) -> float:
    start = time.perf_counter()
    for _ in range(REQUESTS):
        await layer(SCOPE, receive, send)
    return (time.perf_counter() - start) / REQUESTS * 1e6


async def measure(old_path: str) -> dict[str, list[float]]:
    spec = importlib.util.spec_from_file_location("body_limit_old", old_path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    layers = {"before": middleware(old), "after": middleware(body_limit)}
    found: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(ROUNDS):
        for name, layer in layers.items():
            found[name].append(await us_per_request(layer))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="an earlier engine/kvfleet_engine/server/body_limit.py")
    parser.add_argument("--output", help="JSON results to this file")
    args = parser.parse_args()
    found = asyncio.run(measure(args.old))
    for name, values in found.items():
        print(f"{name:<7} µs per request: {' '.join(f'{v:.2f}' for v in values)}")
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"us_per_request": found, "requests_per_round": REQUESTS}, file, indent=1)


if __name__ == "__main__":
    main()
