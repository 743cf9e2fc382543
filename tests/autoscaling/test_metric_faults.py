"""The Builtin autoscaler under metric faults: values no engine reports (below zero, a ratio
above 1, sums past a float), Prometheus answering what it never would, a series left by a pod's
predecessor, a source that trickles or floods its answer, and someone else's Deployment under
the child's name. What a user sees: the replicas kept, ScalingLimited=True MetricsUnavailable,
a status that the API server accepts, and no tick that fails or hangs."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from test_autoscaling_runtime import NAME, NS, SPEC, T0, FakeCluster, engines, metrics, pod

from kvfleet_operator.autoscaling import sources
from kvfleet_operator.autoscaling.autoscaler import autoscale_once
from kvfleet_operator.autoscaling.pods import pod_facts
from kvfleet_operator.autoscaling.sources import query_prometheus, scrape_pods


def limited(cluster: FakeCluster) -> tuple[str, str]:
    condition = next(
        c for c in cluster.infd["status"]["conditions"] if c["type"] == "ScalingLimited"
    )
    return condition["status"], condition["reason"]


def scaled(cluster: FakeCluster) -> list[Any]:
    return [w for w in cluster.writes if w[0] == "scale"]


def three_pods() -> list[dict[str, Any]]:
    return [pod(f"p{i}", f"127.1.0.{i}") for i in range(3)]


@pytest.mark.parametrize(
    ("target", "series", "bad"),
    [
        # Before: -50 waiting requests asked for ceil(-150/2) replicas: drained to minReplicas.
        ({"waitingRequestsPerReplica": 2}, "kvfleet_requests_waiting", "-50"),
        # Before: a KV ratio below zero read as 0 (an idle fleet): drained to minReplicas.
        ({"kvCacheUtilization": 0.8}, "kvfleet_kv_cache_usage_ratio", "-3"),
        # Before: a percentage where the ratio goes (50 for half full): scaled to maxReplicas.
        ({"kvCacheUtilization": 0.8}, "kvfleet_kv_cache_usage_ratio", "50"),
    ],
)
async def test_a_value_no_engine_reports_is_no_data_not_load(target, series, bad) -> None:
    spec = {**SPEC, "targets": target}
    cluster = FakeCluster(spec, 3, three_pods())
    text = metrics(0.0).replace(
        f'{series}{{model_name="m"}} 0.1', f'{series}{{model_name="m"}} {bad}'
    )
    text = text.replace(f'{series}{{model_name="m"}} 0\n', f'{series}{{model_name="m"}} {bad}\n')
    assert f" {bad}\n" in text
    async with engines({f"127.1.0.{i}": text for i in range(3)}) as http:
        decision, _ = await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 3
    assert scaled(cluster) == []
    assert limited(cluster) == ("True", "MetricsUnavailable")


async def test_counters_that_add_up_past_a_float_leave_a_status_the_api_server_takes() -> None:
    """Two series of a counter at 1e308 sum to +Inf: before, the saved state carried it and its
    JSON (Infinity) was refused by the API server on every tick; now the pod has no data."""
    cluster = FakeCluster(SPEC, 2, three_pods()[:2])
    huge = metrics(0.0) + 'kvfleet_generation_tokens_total{model_name="n"} 1e308\n'
    huge = huge.replace(
        'kvfleet_generation_tokens_total{model_name="m"} 0.0',
        'kvfleet_generation_tokens_total{model_name="m"} 1e308',
    )
    async with engines({"127.1.0.0": huge, "127.1.0.1": huge}) as http:
        decision, _ = await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 2
    json.dumps(cluster.infd["status"], allow_nan=False)  # what the API server would accept
    assert limited(cluster) == ("True", "MetricsUnavailable")


PROMETHEUS_SPEC = {**SPEC, "source": "Prometheus", "prometheus": {"url": "http://prom:9090"}}
SERIES = {"metric": {"__name__": "kvfleet_requests_waiting", "pod": "p0"}, "value": [T0, "1"]}


@pytest.mark.parametrize(
    "answer",
    [
        b"<html><body>502 Bad Gateway</body></html>",  # a proxy in front of it
        b"[]",
        b'{"status": "success", "data": null}',
        b'{"status": "success", "data": {"result": "x"}}',
        json.dumps({"status": "success", "data": {"result": [{"metric": {"pod": "p0"}}]}}).encode(),
        json.dumps(
            {"status": "success", "data": {"result": [{**SERIES, "metric": {"pod": "p0"}}]}}
        ).encode(),
        b'{"status": "error", "errorType": "timeout", "error": "query timed out"}',
    ],
)
async def test_prometheus_answering_what_it_never_would_holds_the_replicas(answer) -> None:
    """Before, an answer in another shape raised out of the tick (a traceback every tick, the
    status left as it was); now every pod has no data: the replicas stay, and status says so."""
    cluster = FakeCluster(PROMETHEUS_SPEC, 3, three_pods())

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=answer)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        decision, _ = await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 3
    assert scaled(cluster) == []
    assert limited(cluster) == ("True", "MetricsUnavailable")
    assert cluster.infd["status"]["autoscaling"]["reason"].startswith("hold: no metrics")


async def test_a_series_left_by_a_pods_predecessor_is_not_counted() -> None:
    """A StatefulSet group's leader replaced under the same name: its predecessor's series
    (another instance) stops 100 s before the new one's newest sample. Before, its frozen
    gauges were added in (50 waiting requests that no longer exist); now only the live ones."""

    def series(instance: str, name: str, value: float, at: float) -> dict[str, Any]:
        metric = {"__name__": name, "namespace": NS, "pod": "g-0-0", "instance": instance}
        return {"metric": metric, "values": [[at, str(value)]]}

    names = ("kvfleet_generation_tokens_total", "kvfleet_prompt_tokens_total",
             "kvfleet_kv_cache_usage_ratio", "kvfleet_requests_waiting")  # fmt: skip
    old = [series("10.0.0.1:8000", n, 50 if "waiting" in n else 0.9, T0 - 100) for n in names]
    new = [series("10.0.0.2:8000", n, 0.1 if "ratio" in n else 0, T0 - 3) for n in names]

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "success", "data": {"result": old + new}})

    leader = pod_facts(pod("g-0-0", "10.0.0.2"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        samples = await query_prometheus(http, "http://prom:9090", NS, [leader], T0)  # type: ignore[list-item]
    sample = samples["g-0-0"]
    assert sample is not None and sample.time == T0 - 3
    assert (sample.requests_waiting, sample.kv_cache_usage) == (0, 0.1)


def stream(chunk: bytes, count: int, pause: float, pulled: list[int]) -> AsyncIterator[bytes]:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(count):
            pulled.append(len(chunk))
            await asyncio.sleep(pause)
            yield chunk

    return body()


async def test_an_engine_that_trickles_its_metrics_does_not_hold_the_tick(monkeypatch) -> None:
    """httpx's timeout is per read: a /metrics answer that sends a line every 0.1 s never trips
    it. Before, that one pod held every tick for as long as it went on; now its read ends after
    SCRAPE_TIMEOUT_SECONDS in all, it has no data, and the other pods' numbers are read."""
    monkeypatch.setattr(sources, "SCRAPE_TIMEOUT_SECONDS", 0.5)
    good = metrics(100.0)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "127.1.0.1":
            return httpx.Response(200, content=stream(b"# HELP\n", 10_000, 0.1, []))
        return httpx.Response(200, text=good)

    pods = [pod_facts(pod(f"p{i}", f"127.1.0.{i}")) for i in range(2)]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        samples = await asyncio.wait_for(scrape_pods(http, pods, T0), 5)  # type: ignore[arg-type]
    assert samples["p1"] is None
    assert samples["p0"] is not None and samples["p0"].generation_tokens_total == 100


async def test_a_flood_for_metrics_is_cut_off_at_the_cap(monkeypatch) -> None:
    """A wrong target that serves a huge file as /metrics: before, all of it was read into
    memory (then refused by the parser); now the read stops past MAX_BODY_BYTES."""
    monkeypatch.setattr(sources, "MAX_BODY_BYTES", 1 << 20)
    pulled: list[int] = []

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=stream(b"x" * 65536, 1024, 0, pulled))  # 64 MiB

    pods = [pod_facts(pod("p0", "127.1.0.0"))]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        samples = await scrape_pods(http, pods, T0)  # type: ignore[arg-type]
    assert samples["p0"] is None
    assert sum(pulled) <= (1 << 20) + 65536


async def test_someone_elses_deployment_of_the_childs_name_is_not_scaled() -> None:
    """A Deployment named as the InferenceDeployment that it does not control (a user's, made
    by hand): before, the autoscaler wrote its spec.replicas; now there is nothing to scale
    (the reconciler reports NameInUse)."""
    cluster = FakeCluster(SPEC, 1, [pod("p1", "127.1.0.2")])
    assert cluster.deployment is not None
    cluster.deployment["metadata"].pop("ownerReferences")
    before = copy.deepcopy(cluster.deployment)
    for now, generated in ((T0, 0.0), (T0 + 5, 2000.0)):  # 400 tok/s: would ask for 4
        async with engines({"127.1.0.2": metrics(generated)}) as http:
            decision, _ = await autoscale_once(cluster, http, NS, NAME, now)  # type: ignore[arg-type]
        assert decision is None
    assert cluster.writes == [] and cluster.deployment == before


def test_a_clock_stepped_back_an_hour_does_not_hold_the_fleet_for_an_hour() -> None:
    """A burst scales to 8, then load drops to half a replica's; the clock steps back an hour
    (an NTP step, the operator restarted on a node whose clock is behind). Before, the state
    saved "in the future" kept the fleet in panic at 8 replicas for the whole hour; now it
    counts as just recorded and the fleet scales down once the usual windows pass."""
    from autoscaling_fleet import Fleet

    from kvfleet_operator.autoscaling.spec import AutoscalingSpec

    spec = AutoscalingSpec.model_validate(
        {**SPEC, "maxReplicas": 10, "behavior": {"warmupSeconds": 0}}
    )
    fleet = Fleet(spec, demand=lambda t: 800 if 0 <= t < 200 else 50, startup=0)
    fleet.run(until=300)
    assert fleet.replicas == 8
    start = 300 - 3600
    fleet.run(until=start + 900, start=start)
    down = [t - start for t, replicas, _ in fleet.timeline if t < 0 and replicas < 8]
    assert down and down[0] <= 400  # the 300 s scale-down stabilization window, and a tick
    assert fleet.replicas == 1


async def test_prometheus_refusing_the_query_is_logged_with_its_reason(caplog) -> None:
    """A 4xx/5xx from Prometheus had been logged as httpx's status line alone; its JSON names
    what was wrong (a bad label matcher, a query past its limits)."""
    error = {"status": "error", "errorType": "bad_data", "error": 'parse error: unexpected "}"'}

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json=error)

    pods = [pod_facts(p) for p in three_pods()]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        with caplog.at_level("WARNING", logger="kvfleet_operator.autoscaling.sources"):
            samples = await query_prometheus(http, "http://prometheus:9090", NS, pods, T0)
    assert set(samples.values()) == {None}
    assert '400 Bad Request: parse error: unexpected "}"' in caplog.text
