"""Faults of the replicas and of discovery (found by probing the router with them): a /metrics
that answers NaN, negative or huge numbers or never ends, EndpointSlices of odd shapes, a
Kubernetes API that answers 410 Gone or falls silent, and replicas that leave while a request
is on its way to them."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import tracemalloc

import aiohttp
import pytest
from aiohttp import web
from fake_engine import MODEL
from router_fixtures import StartEngines, StartRouter

from kvfleet_router.discovery import ready_endpoints
from kvfleet_router.load import MAX_METRICS_BYTES, parse_load
from kvfleet_router.prefix_index import MAX_CAPACITY_BLOCKS, capacity_blocks
from kvfleet_router.replicas import ReplicaPool
from kvfleet_router.strategies.base import RoutedRequest
from kvfleet_router.strategies.prefix import PrefixAffinity
from kvfleet_router.upstream import REPLICA_HEADER

COMPLETION = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()


def metrics(waiting: str, kv_usage: str = "0.0", num_gpu_blocks: str = "1000") -> str:
    label = f'{{model_name="{MODEL}"}}'
    return (
        f"kvfleet_requests_waiting{label} {waiting}\n"
        f"kvfleet_kv_cache_usage_ratio{label} {kv_usage}\n"
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{num_gpu_blocks}"}} 1.0\n'
    )


@pytest.mark.parametrize(
    ("waiting", "kv_usage"),
    [("NaN", "0.0"), ("-1e9", "0.0"), ("+Inf", "0.0"), ("-1", "0.0"), ("0", "NaN"), ("0", "-3")],
)
def test_a_gauge_no_engine_could_export_is_not_a_load(waiting: str, kv_usage: str) -> None:
    """A NaN queue made every comparison false, so the sort put that replica anywhere; a
    negative one made it the least loaded replica by a billion requests, and it got them all."""
    with pytest.raises(ValueError, match="kvfleet_"):
        parse_load(metrics(waiting, kv_usage))


def test_a_kv_usage_past_one_is_read_as_full() -> None:
    assert parse_load(metrics("0", kv_usage="7.5")).kv_usage == 1.0


async def test_a_replica_whose_metrics_say_nan_or_negative_gets_no_traffic(
    start_engines: StartEngines, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    engines = await start_engines(3)
    router = await start_router([e.url for e in engines], strategy="least-load")
    liar, nan, honest = engines
    liar.waiting, nan.waiting = -1e9, math.nan
    await _until(lambda: len(router.router.pool.available()) == 1)
    for _ in range(6):
        response = await router.post("/v1/completions", COMPLETION)
        assert response.status == 200
        assert response.headers[REPLICA_HEADER] == honest.url.removeprefix("http://")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for engine in (liar, nan):
        address = engine.url.removeprefix("http://")
        assert any(address in line and "/metrics" in line for line in warnings), warnings


class FloodingMetrics:
    """An engine whose /metrics never ends (as fast as the loopback carries it)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> FloodingMetrics:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        line = metrics("0").encode() * 1000
        while True:
            await response.write(line)
            self.bytes_sent += len(line)


async def test_a_metrics_answer_that_never_ends_is_not_read_into_memory(
    start_router: StartRouter,
) -> None:
    """Before, the scraper read the whole answer for up to its one-second timeout: hundreds
    of MB held at once, ten times a second."""
    flood = await FloodingMetrics().start()
    try:
        tracemalloc.start()
        router = await start_router([f"http://127.0.0.1:{flood.port}"], wait=False)
        await _until(lambda: flood.bytes_sent > 50 * MAX_METRICS_BYTES, timeout=10)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 8 * MAX_METRICS_BYTES, peak
        assert router.router.pool.available() == []
    finally:
        tracemalloc.stop()
        assert flood.runner is not None
        await flood.runner.cleanup()


def test_a_huge_kv_cache_does_not_unbound_the_prefix_index() -> None:
    """The index is sized by the engine's num_gpu_blocks: 1e18 of them let it grow with every
    prompt the router ever routed there."""
    sample = parse_load(metrics("0", num_gpu_blocks="1e18"))
    capacity = capacity_blocks(sample.num_gpu_blocks, sample.block_size, 64)
    assert capacity == MAX_CAPACITY_BLOCKS
    pool = ReplicaPool()
    pool.set_members({"10.0.0.1:8000": "a"}, reachable=True)
    (replica,) = pool.members.values()
    replica.sample = sample
    strategy = PrefixAffinity(64, 1.25)
    for i in range(MAX_CAPACITY_BLOCKS // 1000 + 10):
        strategy.routed(RoutedRequest(range(i * 1000, (i + 1) * 1000)), replica)
    assert len(strategy._index(replica)) == MAX_CAPACITY_BLOCKS


def pod_ref(name: str) -> dict[str, str]:
    return {"kind": "Pod", "name": name, "namespace": "default"}


def test_odd_endpoint_slices_give_one_replica_per_pod_each_at_a_real_port() -> None:
    slices = [
        {  # dual stack: one slice per address family, the same pods in each
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "targetRef": pod_ref("a")},
                # Several addresses of one endpoint are the same endpoint (the API's rule).
                {"addresses": ["10.0.0.2", "10.0.0.9"], "targetRef": pod_ref("b")},
            ],
        },
        {
            "addressType": "IPv6",
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["fd00::1"], "targetRef": pod_ref("a")},
                {"addresses": ["fd00::2"], "targetRef": pod_ref("b")},
            ],
        },
        {  # a port without its number: the engine's port, never "host:None"
            "ports": [{"name": "http"}],
            "endpoints": [{"addresses": ["10.0.0.3"], "targetRef": pod_ref("c")}],
        },
        {  # the same pod listed twice while the controller moves it between slices
            "ports": None,
            "endpoints": [
                {"addresses": ["10.0.0.4"], "targetRef": pod_ref("d")},
                {"addresses": [], "targetRef": pod_ref("e")},
                {"targetRef": pod_ref("f")},
            ],
        },
        {
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.4"], "targetRef": pod_ref("d")},
            ],
        },
    ]
    assert ready_endpoints(slices) == {
        "10.0.0.1:8000": "a",
        "10.0.0.2:8000": "b",
        "10.0.0.3:8000": "c",
        "10.0.0.4:8000": "d",
    }


async def _until(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


class FakeApiServer:
    """The EndpointSlice list and watch of a Kubernetes API server. `slices` is what a list
    returns; each watch sends the events `watch_events` holds (then stays open, silent), or,
    with `silent`, answers a list or watch with nothing at all."""

    PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"

    def __init__(self) -> None:
        self.slices: list[dict[str, object]] = []
        self.watch_events: list[dict[str, object]] = []
        self.silent: str | None = None  # "list" or "watch": accept it, never answer
        self.num_lists = 0
        self.runner: web.AppRunner | None = None

    async def start(self, tmp_path) -> str:  # type: ignore[no-untyped-def]
        """Serve; the path of a kubeconfig that points at it."""
        app = web.Application()
        app.router.add_get(self.PATH, self._endpointslices)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        port = self.runner.addresses[0][1]
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "fake", "user": {"token": "x"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            })
        )  # fmt: skip
        return str(kubeconfig)

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        watching = request.query.get("watch", "").lower() == "true"
        if self.silent == ("watch" if watching else "list"):
            await asyncio.sleep(3600)
        if not watching:
            self.num_lists += 1
            listing = {"metadata": {"resourceVersion": str(self.num_lists)}, "items": self.slices}
            return web.json_response(listing)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for event in self.watch_events:
            await response.write(json.dumps(event).encode() + b"\n")
        await asyncio.sleep(3600)
        return response


def endpoint_slice(name: str, *pods: tuple[str, str]) -> dict[str, object]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "llama"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [ip], "targetRef": pod_ref(pod)} for pod, ip in pods],
    }


@pytest.fixture
async def api_server(tmp_path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from kubernetes_asyncio.config import kube_config

    from kvfleet_router import discovery

    server = FakeApiServer()
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", await server.start(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(discovery, "RETRY_S", 0.1)
    yield server
    await server.stop()


async def _discover(server: FakeApiServer):  # type: ignore[no-untyped-def]
    from kvfleet_router.discovery import KubernetesDiscovery

    pool = ReplicaPool()
    return pool, asyncio.create_task(KubernetesDiscovery(pool, "default", "llama").run())


async def test_a_watch_that_expired_410_gone_is_listed_again_at_once(
    api_server: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The client library raises the API's ERROR event; the router took it for a failure,
    logged a warning and waited RETRY_S (2 s) before it listed again."""
    from kvfleet_router import discovery

    discovery.RETRY_S = 3.0  # (monkeypatched back) a relist must not wait for it
    caplog.set_level(logging.INFO)
    api_server.slices = [endpoint_slice("llama-a", ("llama-0", "10.0.0.1"))]
    gone = {
        "kind": "Status",
        "code": 410,
        "reason": "Expired",
        "message": "too old resource version",
    }
    api_server.watch_events = [{"type": "ERROR", "object": gone}]
    pool, task = await _discover(api_server)
    try:
        await _until(lambda: "10.0.0.1:8000" in pool.members)
        api_server.slices.append(endpoint_slice("llama-b", ("llama-1", "10.0.0.2")))
        started = time.monotonic()
        await _until(lambda: "10.0.0.2:8000" in pool.members, timeout=5)
        assert time.monotonic() - started < 1.0
    finally:
        task.cancel()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "410 Gone" in caplog.text


@pytest.mark.parametrize("silent", ["list", "watch"])
async def test_an_api_server_that_falls_silent_is_given_up_on_and_listed_again(
    api_server: FakeApiServer, monkeypatch: pytest.MonkeyPatch, silent: str
) -> None:
    """The list and the watch had no client timeout: an API server that took the request and
    never answered (a half-open connection) left the router on its last view for ever."""
    from kvfleet_router import discovery

    monkeypatch.setattr(discovery, "LIST_TIMEOUT_S", 0.3)
    monkeypatch.setattr(discovery, "WATCH_TIMEOUT_S", 0)
    monkeypatch.setattr(discovery, "WATCH_GRACE_S", 0.3)
    api_server.slices = [endpoint_slice("llama-a", ("llama-0", "10.0.0.1"))]
    api_server.silent = "watch" if silent == "watch" else None
    pool, task = await _discover(api_server)
    try:
        await _until(lambda: api_server.num_lists == 1)
        if silent == "list":
            api_server.silent = "list"
            await asyncio.sleep(0.5)  # the watch ends (the server's own timeout): a list hangs
        api_server.slices = [endpoint_slice("llama-a", ("llama-1", "10.0.0.2"))]
        api_server.silent = None if silent == "list" else "watch"
        await _until(lambda: "10.0.0.2:8000" in pool.members, timeout=5)
    finally:
        task.cancel()


async def test_a_replica_that_left_while_a_request_was_on_another_gets_no_retry(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    """A request's retry order is ranked once; a replica that discovery removed meanwhile (a
    pod deleted, draining) still got the retry, at an address that may no longer be it."""
    engines = await start_engines(2)
    hung, leaving = sorted(engines, key=lambda e: e.url.removeprefix("http://"))
    hung.answer_gate = asyncio.Event()  # never set: the first attempt times out
    router = await start_router(
        [e.url for e in engines], strategy="round-robin", upstream_first_byte_timeout_s=0.5
    )
    pool = router.router.pool
    sent = asyncio.create_task(router.post("/v1/completions", COMPLETION))
    await _until(lambda: len(hung.bodies) == 1)
    pool.set_members({a: r.name for a, r in pool.members.items() if a in hung.url}, reachable=True)
    response = await sent
    assert leaving.bodies == []
    assert response.status == 504


async def test_a_large_fleet_is_scraped_at_a_bounded_total_rate(
    start_engines: StartEngines, start_router: StartRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each replica was read ten times a second however many there were: thousands of
    endpoints kept the router's event loop busy with scrapes instead of requests."""
    from kvfleet_router import load

    monkeypatch.setattr(load, "MAX_SCRAPES_PER_S", 20.0)  # 4 replicas: 5 Hz each, not 10
    engines = await start_engines(4)
    await start_router([e.url for e in engines])
    before = [e.metrics_reads for e in engines]
    await asyncio.sleep(2.0)
    rates = [(e.metrics_reads - b) / 2.0 for e, b in zip(engines, before, strict=True)]
    assert all(2.5 <= rate <= 6.5 for rate in rates), rates


async def test_thousands_of_endpoints_log_what_changed_not_the_whole_list(
    api_server: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Every change logged the whole list of replicas: 80 KB a line at 2,000 endpoints, one
    line per pod a rollout moves."""
    caplog.set_level(logging.INFO, logger="kvfleet_router.discovery")
    pods = [(f"llama-{i}", f"10.0.{i // 250}.{i % 250 + 1}") for i in range(2000)]
    api_server.slices = [
        endpoint_slice(f"llama-{n}", *pods[n * 100 : (n + 1) * 100]) for n in range(20)
    ]
    moved = endpoint_slice("llama-0", ("llama-new", "10.9.9.9"), *pods[1:100])
    api_server.watch_events = [{"type": "MODIFIED", "object": moved}]
    pool, task = await _discover(api_server)
    try:
        await _until(lambda: "10.9.9.9:8000" in pool.members)
    finally:
        task.cancel()
    assert len(pool.members) == 2000
    lines = [r.getMessage() for r in caplog.records if "replicas of" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "2000 ready; +2000: llama-0 (10.0.0.1:8000), " in lines[0]
    assert lines[0].endswith(" and 1990 more")
    assert lines[1].endswith(
        "2000 ready; +1: llama-new (10.9.9.9:8000); -1: llama-0 (10.0.0.1:8000)"
    )


def test_a_few_replicas_are_logged_by_name() -> None:
    from kvfleet_router.discovery import describe_change

    assert describe_change({}, {"10.0.0.1:8000": "a", "10.0.0.2:8000": "b"}) == (
        "a (10.0.0.1:8000), b (10.0.0.2:8000)"
    )
    assert describe_change({"10.0.0.1:8000": "a"}, {}) == "none"


@pytest.mark.parametrize("fault", ["dies", "falls silent"])
async def test_a_stream_cut_by_its_replica_ends_with_an_error_event_then_broken(
    start_engines: StartEngines, start_router: StartRouter, fault: str
) -> None:
    """The client's connection was aborted with no word: an OpenAI client raised a bare
    connection error. Now it reads an error event, as the engine sends when it gives up on a
    stream, and the body still ends broken (never a short answer that looks whole)."""
    (engine,) = await start_engines(1)
    if fault == "dies":
        engine.die_mid_stream = True
    else:
        engine.stream_gate = asyncio.Event()  # never set
    router = await start_router([engine.url], upstream_idle_timeout_s=0.3)
    stream = json.dumps({"model": MODEL, "prompt": "Hello", "stream": True}).encode()
    response = await router.post("/v1/completions", stream)
    assert response.status == 200
    assert await response.content.readuntil(b"\n\n") == b'data: {"n": 1}\n\n'
    event = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 3)
    error = json.loads(event.removeprefix(b"data: "))["error"]
    replica = engine.url.removeprefix("http://")
    if fault == "dies":
        assert error["type"] == "bad_gateway"
        assert (
            error["message"]
            == f"replica {replica} closed the stream before its end; the answer is cut"
        )
    else:
        assert error["type"] == "gateway_timeout"
        assert "--upstream-idle-timeout" in error["message"]
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(response.content.read(), 2)
