"""Record an autoscaler trace from a live engine: poll its /metrics while `kvfleet bench serve`
loads it in phases, keep the lines of the metric contract. The replay test feeds the recording
to the decision function.

    .venv/bin/python tests/autoscaling/record_trace.py --url http://127.0.0.1:8000 \
        --out tests/autoscaling/traces/tiny-cpu-step.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import httpx

KEEP = (
    "kvfleet_generation_tokens_total",
    "kvfleet_prompt_tokens_total",
    "kvfleet_kv_cache_usage_ratio",
    "kvfleet_requests_waiting",
    "kvfleet_requests_running",
    "kvfleet_engine_capacity_tokens_per_second",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--idle-before", type=float, default=10.0)
    parser.add_argument("--load-prompts", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--idle-after", type=float, default=20.0)
    args = parser.parse_args()

    samples: list[dict[str, object]] = []
    phases: dict[str, float] = {}
    done = threading.Event()
    start = time.time()

    def poll() -> None:
        while not done.is_set():
            try:
                text = httpx.get(f"{args.url}/metrics", timeout=2).text
                lines = [line for line in text.splitlines() if line.startswith(KEEP)]
                samples.append({"t": round(time.time() - start, 3), "metrics": lines})
            except httpx.HTTPError as exc:
                samples.append({"t": round(time.time() - start, 3), "error": str(exc)})
            done.wait(1.0)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(args.idle_before)
    phases["load_start"] = round(time.time() - start, 3)
    bench = [
        sys.executable,
        "-m",
        "kvfleet_cli",
        "bench",
        "serve",
        "--url",
        args.url,
        "--concurrency",
        str(args.concurrency),
        "--num-prompts",
        str(args.load_prompts),
        "--random-input-len",
        "32",
        "--random-output-len",
        "64",
        "--ignore-eos",
        "--no-progress",
    ]
    subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
    phases["load_end"] = round(time.time() - start, 3)
    time.sleep(args.idle_after)
    done.set()
    poller.join()
    with open(args.out, "w") as out:
        json.dump(
            {"command": " ".join(sys.argv), "phases": phases, "samples": samples}, out, indent=0
        )
    print(f"{len(samples)} samples, phases {phases} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
