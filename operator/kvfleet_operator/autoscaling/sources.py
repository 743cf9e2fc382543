"""Where engine metrics come from: each ready pod's /metrics (Direct), or Prometheus.

Both return one `EngineSample` per pod (None where the read failed), so the decision function
is the same for both: Prometheus only replaces the HTTP scrape, the windows stay ours.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import defaultdict

import httpx

from kvfleet_operator.api import ENGINE_PORT
from kvfleet_operator.autoscaling import promtext
from kvfleet_operator.autoscaling.pods import PodFacts
from kvfleet_operator.autoscaling.samples import EngineSample, RouterDemand

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_SECONDS = 2.0
# The Prometheus source reads each series' raw samples of the last LOOKBACK_SECONDS (a range
# selector, so each comes with the time it was scraped: an instant query would stamp a target's
# last value with the evaluation time for 5 minutes after its scrapes stop, and a frozen counter
# would read as zero load). A pod whose newest sample is older than STALE_SECONDS (four of the
# ServiceMonitor's 15 s scrapes) has no data: the autoscaler holds.
LOOKBACK_SECONDS = 120
STALE_SECONDS = 60.0
_METRIC_NAMES = (
    promtext.GENERATION_TOKENS,
    promtext.PROMPT_TOKENS,
    promtext.KV_CACHE_USAGE,
    promtext.REQUESTS_WAITING,
    promtext.REQUESTS_RUNNING,
    promtext.CAPACITY,
    promtext.TTFT + "_bucket",
    promtext.TPOT + "_bucket",
)


async def scrape_pods(
    http: httpx.AsyncClient, pods: list[PodFacts], now: float, port: int = ENGINE_PORT
) -> dict[str, EngineSample | None]:
    """GET http://<podIP>:<port>/metrics of every ready pod, concurrently."""
    ready = [pod for pod in pods if pod.ready_since is not None and pod.ip]
    results = await asyncio.gather(*(_scrape(http, pod, now, port) for pod in ready))
    return {pod.name: sample for pod, sample in zip(ready, results, strict=True)}


async def _scrape(
    http: httpx.AsyncClient, pod: PodFacts, now: float, port: int
) -> EngineSample | None:
    host = f"[{pod.ip}]" if pod.ip and ":" in pod.ip else pod.ip
    url = f"http://{host}:{port}/metrics"
    try:
        response = await http.get(url, timeout=SCRAPE_TIMEOUT_SECONDS)
        response.raise_for_status()
        return promtext.engine_sample(promtext.parse(response.text), time=now)
    except (httpx.HTTPError, promtext.ParseError) as exc:
        log.info("no metrics from pod %s (%s): %s", pod.name, url, exc)
        return None


async def scrape_routers(
    http: httpx.AsyncClient, pods: list[PodFacts], port: int = ENGINE_PORT
) -> RouterDemand | None:
    """The routers' demand, summed over the ready router pods that answered; None when none
    did. Idle (the least idle time of them) only when every ready router answered: one that
    did not may be serving, so scaling to zero waits for the next tick (its queue, the signal
    to scale up from zero, needs only one router to tell)."""
    ready = [pod for pod in pods if pod.ready_since is not None and pod.ip]
    demands = [
        d for d in await asyncio.gather(*(_scrape_router(http, p, port) for p in ready)) if d
    ]
    if not demands:
        return None
    return RouterDemand(
        queued=sum(d.queued for d in demands),
        in_flight=sum(d.in_flight for d in demands),
        idle_seconds=min(d.idle_seconds for d in demands) if len(demands) == len(ready) else 0.0,
    )


async def _scrape_router(http: httpx.AsyncClient, pod: PodFacts, port: int) -> RouterDemand | None:
    host = f"[{pod.ip}]" if pod.ip and ":" in pod.ip else pod.ip
    url = f"http://{host}:{port}/metrics"
    try:
        response = await http.get(url, timeout=SCRAPE_TIMEOUT_SECONDS)
        response.raise_for_status()
        return promtext.router_demand(promtext.parse(response.text))
    except (httpx.HTTPError, promtext.ParseError) as exc:
        log.info("no demand from router pod %s (%s): %s", pod.name, url, exc)
        return None


def _promql_regex(value: str) -> str:
    """`value` matched literally by a PromQL regex in a double-quoted string. Not re.escape: it
    writes `\\-` for "-" (every pod name has one), which PromQL's string parser refuses (HTTP 400);
    RE2's metacharacters get a backslash, doubled for the string literal."""
    return re.sub(r"([.+*?()|\[\]{}^$\\])", r"\\\\\1", value)


async def query_prometheus(
    http: httpx.AsyncClient, base_url: str, namespace: str, pods: list[PodFacts], now: float
) -> dict[str, EngineSample | None]:
    """One query for the contract's series of the ready pods (by `namespace` and `pod` target
    labels) over the last LOOKBACK_SECONDS; each pod's sample carries the scrape time of its
    newest series, and a pod scraped last more than STALE_SECONDS ago has none."""
    ready = [pod for pod in pods if pod.ready_since is not None]
    if not ready:
        return {}
    names = "|".join(_promql_regex(name) for name in _METRIC_NAMES)
    pod_names = "|".join(_promql_regex(pod.name) for pod in ready)
    query = (
        f'{{__name__=~"{names}",namespace="{namespace}",pod=~"{pod_names}"}}[{LOOKBACK_SECONDS}s]'
    )
    try:
        response = await http.get(
            base_url.rstrip("/") + "/api/v1/query",
            params={"query": query, "time": f"{now:.3f}"},
            timeout=SCRAPE_TIMEOUT_SECONDS * 2,
        )
        response.raise_for_status()
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(body.get("error", "query failed"))
        series = body["data"]["result"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        log.warning("Prometheus query at %s failed: %s", base_url, exc)
        return {pod.name: None for pod in ready}
    by_pod: dict[str, list[promtext.Sample]] = defaultdict(list)
    newest: dict[str, float] = defaultdict(float)
    for item in series:
        labels = dict(item["metric"])
        pod_name = labels.get("pod", "")
        # A range selector answers a matrix ("values", oldest first); take each series' newest.
        timestamp, value = (item.get("values") or [item.get("value")])[-1]
        by_pod[pod_name].append(promtext.Sample(labels.pop("__name__"), labels, float(value)))
        newest[pod_name] = max(newest[pod_name], float(timestamp))
    samples: dict[str, EngineSample | None] = {}
    for pod in ready:
        if pod.name in newest and now - newest[pod.name] > STALE_SECONDS:
            log.info(
                "pod %s: its newest sample in Prometheus is %.0f s old",
                pod.name,
                now - newest[pod.name],
            )
            samples[pod.name] = None
            continue
        try:
            samples[pod.name] = promtext.engine_sample(by_pod[pod.name], time=newest[pod.name])
        except promtext.ParseError as exc:
            log.info("incomplete series for pod %s in Prometheus: %s", pod.name, exc)
            samples[pod.name] = None
    return samples
