"""The Prometheus source's instant query is one Prometheus accepts: pod names (with "-", maybe
".") and metric names matched literally, escaped for PromQL's string literal, not Python's re.
(e2e/test_prometheus.py runs it against a real Prometheus, which answered 400 to re.escape's
`\\-`.)"""

from __future__ import annotations

import httpx

from kvfleet_operator.autoscaling.pods import PodFacts
from kvfleet_operator.autoscaling.sources import query_prometheus


def _pod(name: str) -> PodFacts:
    return PodFacts(name=name, ip="127.1.0.2", ready_since=0.0, unschedulable=False,
                    deletion_cost=None)  # fmt: skip


async def test_pod_names_are_matched_literally_in_a_string_promql_accepts() -> None:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.params["query"])
        return httpx.Response(200, json={"status": "success", "data": {"result": []}})

    pods = [_pod("tiny-7cd69dddd9-j9r8d"), _pod("llama.v2-5d8f-abcde")]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        await query_prometheus(http, "http://prom:9090", "team-a", pods, 0.0)
    query = seen[0]
    assert 'pod=~"tiny-7cd69dddd9-j9r8d|llama\\\\.v2-5d8f-abcde"' in query
    assert "\\-" not in query  # PromQL refuses unknown escapes in a string
    assert '__name__=~"kvfleet_generation_tokens_total|' in query
