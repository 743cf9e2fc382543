"""/metrics while requests run, and what a client disconnect frees."""

from __future__ import annotations

import threading
import time

import httpx
from serverutil import MODEL_NAME, metric, scrape

LABEL = f'{{model_name="{MODEL_NAME}"}}'
# As long as the test server's context allows (512), so it is still running when scraped.
LONG = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 500, "ignore_eos": True, "stream": True}


def wait_for(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_metrics_move_while_requests_run(live_server) -> None:  # type: ignore[no-untyped-def]
    url = live_server.url
    before = scrape(url)
    success_before = metric(before, 'kvfleet_request_success_total{finish_reason="length"')
    tokens_before = metric(before, f"kvfleet_generation_tokens_total{LABEL}")
    done = threading.Event()

    def run() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=120) as r:
            for _ in r.iter_lines():
                pass
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    scrapes: list[str] = []

    def running() -> bool:
        scrapes.append(scrape(url))
        return metric(scrapes[-1], f"vllm:num_requests_running{LABEL}") >= 1

    wait_for(running)
    # The scrape that saw it running holds its KV blocks too (one snapshot of the engine).
    assert metric(scrapes[-1], f"kvfleet_kv_cache_usage_ratio{LABEL}") > 0
    first = metric(scrapes[-1], f"kvfleet_generation_tokens_total{LABEL}")
    wait_for(lambda: metric(scrape(url), f"kvfleet_generation_tokens_total{LABEL}") > first)
    assert not done.is_set(), "request finished before metrics could be seen moving"
    worker.join(120)
    after = scrape(url)
    assert metric(after, f"kvfleet_generation_tokens_total{LABEL}") >= tokens_before + 500
    assert (
        metric(after, 'kvfleet_request_success_total{finish_reason="length"') == success_before + 1
    )
    assert metric(after, f"vllm:time_to_first_token_seconds_count{LABEL}") >= 1
    assert metric(after, f"kvfleet_inter_token_latency_seconds_count{LABEL}") >= 499
    assert metric(after, f"kvfleet_engine_capacity_tokens_per_second{LABEL}") > 0


def test_disconnect_aborts_the_request_and_frees_its_blocks(live_server) -> None:  # type: ignore[no-untyped-def]
    url = live_server.url
    aborted = 'kvfleet_request_success_total{finish_reason="abort"'
    aborts_before = metric(scrape(url), aborted)
    body = {**LONG, "max_tokens": 400}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(4)]  # some tokens arrived: it is running
        assert any(line.startswith("data: {") for line in received)
        assert metric(scrape(url), f"kvfleet_kv_cache_usage_ratio{LABEL}") > 0
    # The client hung up: the server aborts the request and its KV blocks return to the pool.
    wait_for(lambda: metric(scrape(url), aborted) == aborts_before + 1, timeout_s=30)
    wait_for(lambda: metric(scrape(url), f"kvfleet_kv_cache_usage_ratio{LABEL}") == 0.0)
    assert metric(scrape(url), f"kvfleet_requests_running{LABEL}") == 0
    assert live_server.state.engine.num_in_flight == 0
