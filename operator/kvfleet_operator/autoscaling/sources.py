"""Where engine metrics come from: each ready pod's /metrics (Direct), or Prometheus.

Both return one `EngineSample` per pod (None where the read failed), so the decision function
is the same for both: Prometheus only replaces the HTTP scrape, the windows stay ours.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import defaultdict

import httpx

from kvfleet_operator.api import ENGINE_PORT
from kvfleet_operator.autoscaling import promtext
from kvfleet_operator.autoscaling.pods import PodFacts
from kvfleet_operator.autoscaling.samples import EngineSample, RouterDemand

log = logging.getLogger(__name__)

# A read (an engine's /metrics, a router's, a Prometheus query) gets this long in all: a server
# that trickles its answer holds no tick, since httpx's own timeout is per socket read. Its
# answer may be this large: a wrong target that serves a huge file costs no memory.
SCRAPE_TIMEOUT_SECONDS = 2.0
QUERY_TIMEOUT_SECONDS = 2 * SCRAPE_TIMEOUT_SECONDS
MAX_BODY_BYTES = 16 * 1024 * 1024
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


class BadAnswer(ValueError):
    """An answer that is not what the source serves: too large, or not in its shape."""


# What a read of a source may end in, besides an answer: each means "no data" for its pods.
READ_ERRORS = (httpx.HTTPError, TimeoutError, BadAnswer, promtext.ParseError)


async def _read(
    http: httpx.AsyncClient,
    url: str,
    timeout: float,
    params: dict[str, str] | None = None,
) -> str:
    """The body of GET `url`: BadAnswer on an error status (with the source's own error text:
    Prometheus says what was wrong with the query) and past MAX_BODY_BYTES, TimeoutError when
    the whole answer takes longer than `timeout`."""
    chunks, size = [], 0
    async with asyncio.timeout(timeout):
        async with http.stream("GET", url, params=params, timeout=timeout) as response:
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise BadAnswer(f"the answer is larger than {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
    text = b"".join(chunks).decode("utf-8", errors="replace")
    if response.is_error:
        raise BadAnswer(f"{response.status_code} {response.reason_phrase}: {_error_text(text)}")
    return text


def _error_text(body: str) -> str:
    """An error answer's message: Prometheus' `error` field, else the body's first line."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    text = error if isinstance(error, str) else (body.strip().splitlines() or [""])[0]
    return text[:200] or "(no body)"


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__  # a TimeoutError has no text of its own


async def _scrape(
    http: httpx.AsyncClient, pod: PodFacts, now: float, port: int
) -> EngineSample | None:
    host = f"[{pod.ip}]" if pod.ip and ":" in pod.ip else pod.ip
    url = f"http://{host}:{port}/metrics"
    try:
        text = await _read(http, url, SCRAPE_TIMEOUT_SECONDS)
        return promtext.engine_sample(promtext.parse(text), time=now)
    except READ_ERRORS as exc:
        log.info("no metrics from pod %s (%s): %s", pod.name, url, _describe(exc))
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
        text = await _read(http, url, SCRAPE_TIMEOUT_SECONDS)
        return promtext.router_demand(promtext.parse(text))
    except READ_ERRORS as exc:
        log.info("no demand from router pod %s (%s): %s", pod.name, url, _describe(exc))
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
    newest series, and a pod scraped last more than STALE_SECONDS ago has none. A series whose
    scrapes stopped that long ago is left out of its pod's sample: a pod created again under its
    name (a StatefulSet group's) has a new series beside its predecessor's for a while. An
    answer Prometheus would not give (an error, HTML, another shape, too large or too slow)
    is no data for every pod."""
    ready = [pod for pod in pods if pod.ready_since is not None]
    if not ready:
        return {}
    names = "|".join(_promql_regex(name) for name in _METRIC_NAMES)
    pod_names = "|".join(_promql_regex(pod.name) for pod in ready)
    query = (
        f'{{__name__=~"{names}",namespace="{namespace}",pod=~"{pod_names}"}}[{LOOKBACK_SECONDS}s]'
    )
    url = base_url.rstrip("/") + "/api/v1/query"
    try:
        text = await _read(
            http, url, QUERY_TIMEOUT_SECONDS, params={"query": query, "time": f"{now:.3f}"}
        )
        series = _newest_samples(text)
    except READ_ERRORS as exc:
        log.warning("Prometheus query at %s failed: %s", base_url, _describe(exc))
        return {pod.name: None for pod in ready}
    by_pod: dict[str, list[promtext.Sample]] = defaultdict(list)
    newest: dict[str, float] = defaultdict(float)
    for sample, timestamp in series:
        pod_name = sample.labels.get("pod", "")
        newest[pod_name] = max(newest[pod_name], timestamp)
        if now - timestamp <= STALE_SECONDS:
            by_pod[pod_name].append(sample)
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


def _newest_samples(text: str) -> list[tuple[promtext.Sample, float]]:
    """Each series of a Prometheus query answer, its newest sample and that sample's time.
    BadAnswer for anything but a successful vector or matrix of named series."""
    try:
        body = json.loads(text)
    except ValueError:
        raise BadAnswer(f"not JSON: {text[:80]!r}") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else None
        raise BadAnswer(str(error or f"not a successful query answer: {text[:80]!r}"))
    try:
        found = []
        for item in body["data"]["result"]:
            labels = {str(k): str(v) for k, v in dict(item["metric"]).items()}
            # A range selector answers a matrix ("values", oldest first); take the newest.
            timestamp, value = (item.get("values") or [item.get("value")])[-1]
            name = labels.pop("__name__")
            found.append((promtext.Sample(name, labels, float(value)), float(timestamp)))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise BadAnswer(f"a series not in the shape of a query answer ({exc!r})") from None
    return found
