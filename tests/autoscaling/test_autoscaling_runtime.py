"""The autoscaler's tick against a fake API server and fake engines: what it writes and where."""

from __future__ import annotations

import copy
from typing import Any

import httpx
from kubernetes_asyncio.client.exceptions import ApiException

from kvfleet_operator.autoscaling.autoscaler import autoscale_once
from kvfleet_operator.autoscaling.pods import DELETION_COST
from status_patch import merge_patch

NS, NAME = "team", "llama"
T0 = 1_700_000_000.0  # after the pods became ready (2020)


def metrics(generated: float, running: float = 0, kv: float = 0.1) -> str:
    return (
        f'kvfleet_generation_tokens_total{{model_name="m"}} {generated}\n'
        f'kvfleet_prompt_tokens_total{{model_name="m"}} {generated}\n'
        f'kvfleet_kv_cache_usage_ratio{{model_name="m"}} {kv}\n'
        f'kvfleet_requests_waiting{{model_name="m"}} 0\n'
        f'kvfleet_requests_running{{model_name="m"}} {running}\n'
        'kvfleet_engine_capacity_tokens_per_second{model_name="m"} 400\n'
    )


def pod(name: str, ip: str, ready: bool = True, unschedulable: bool = False) -> dict[str, Any]:
    conditions = [
        {
            "type": "Ready",
            "status": "True" if ready else "False",
            "lastTransitionTime": "2020-01-01T00:00:00Z",
        }
    ]
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable"})
    return {
        "metadata": {"name": name, "namespace": NS, "creationTimestamp": "2020-01-01T00:00:00Z"},
        "status": {"podIP": ip, "phase": "Running", "conditions": conditions},
    }


# The controller reference the reconciler puts on every child of the InferenceDeployment.
OWNER = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment", "name": NAME,
         "uid": "u1", "controller": True}  # fmt: skip


class FakeCluster:
    """The subset of kvfleet_operator.apply.Cluster the autoscaler uses, recording writes."""

    def __init__(self, autoscaling: dict[str, Any], replicas: int, pods: list[dict[str, Any]]):
        self.infd = {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": NAME, "namespace": NS, "uid": "u1", "generation": 3},
            "spec": {"model": {"uri": "file:///m"}, "autoscaling": autoscaling},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
        self.deployment: dict[str, Any] | None = {
            "metadata": {"name": NAME, "namespace": NS, "ownerReferences": [OWNER]},
            "spec": {"replicas": replicas},
        }
        self.statefulsets: list[dict[str, Any]] = []  # StatefulSet groups (no Deployment)
        self.pods = pods
        self.pod_selector = f"kvfleet.io/deployment={NAME}"
        self.writes: list[tuple[str, Any]] = []
        self.external: dict[str, dict[str, Any]] = {}
        self.resource_version = "1"
        self.infd["metadata"]["resourceVersion"] = "1"

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None):
        self.writes.append(("delete", kind))
        return self.external.pop(kind, None) is not None

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None):
        if kind in self.external:
            return copy.deepcopy(self.external[kind])
        if kind == "InferenceDeployment":
            return copy.deepcopy(self.infd)
        if kind == "Deployment":
            return copy.deepcopy(self.deployment)
        return None  # no LeaderWorkerSet

    async def list(
        self, api_version: str, kind: str, namespace: str | None = None, selector: str = ""
    ):
        if kind == "StatefulSet":
            assert selector == f"kvfleet.io/deployment={NAME}"
            return copy.deepcopy(self.statefulsets)
        assert selector == self.pod_selector, selector
        return copy.deepcopy(self.pods)

    async def scale(
        self, namespace: str, name: str, replicas: int, api_version="apps/v1", kind="Deployment"
    ) -> dict[str, Any]:
        assert (api_version, kind, name) == ("apps/v1", "Deployment", NAME)
        assert self.deployment is not None
        self.writes.append(("scale", replicas))
        self.deployment["spec"]["replicas"] = replicas
        return {}

    async def apply(self, manifest: dict[str, Any], *, field_manager: str, owner=None):
        self.writes.append(("apply", (manifest, field_manager)))
        return manifest

    async def patch_status(self, api_version, kind, name, namespace, status, resource_version=None):
        if resource_version is not None and resource_version != self.resource_version:
            raise ApiException(status=409, reason="Conflict")
        self.writes.append(("status", status))
        self.infd["status"] = merge_patch(self.infd["status"], status)
        self.bump()
        return copy.deepcopy(self.infd)

    def bump(self) -> None:
        self.resource_version = str(int(self.resource_version) + 1)
        self.infd["metadata"]["resourceVersion"] = self.resource_version

    async def post_event(self, involved, type_, reason, message) -> None:
        self.writes.append(("event", reason))


def engines(counters: dict[str, str]) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        body = counters.get(request.url.host)
        if body is None:
            return httpx.Response(503)
        assert request.url.port == 8000 and request.url.path == "/metrics"
        return httpx.Response(200, text=body)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


SPEC = {
    "minReplicas": 1,
    "maxReplicas": 5,
    "targets": {"generationTokenRate": {"tokensPerSecond": 100}},
    "behavior": {"warmupSeconds": 0, "scaleDown": {"stabilizationWindowSeconds": 0}},
}


async def test_scales_up_writes_replicas_and_status_never_spec() -> None:
    cluster = FakeCluster(SPEC, 1, [pod("p1", "127.1.0.2")])
    spec_before = copy.deepcopy(cluster.infd["spec"])
    decision = None
    for now, generated in ((T0, 0.0), (T0 + 5, 2000.0)):  # 400 tok/s on one pod
        async with engines({"127.1.0.2": metrics(generated)}) as http:
            decision, period = await autoscale_once(cluster, http, NS, NAME, now)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 4
    assert period == 5
    assert ("scale", 4) in cluster.writes
    assert ("event", "ScaledUp") in cluster.writes
    assert cluster.infd["spec"] == spec_before
    status = cluster.infd["status"]["autoscaling"]
    assert status["desiredReplicas"] == 4
    assert status["mode"] == "Panic"
    assert status["signals"][0] == {
        "name": "generationTokenRate",
        "value": 400.0,
        "target": 100.0,
        "desiredReplicas": 4,
    }
    # The first tick cannot measure a rate yet (it holds, and says so); the second scales.
    history = [(h["fromReplicas"], h["toReplicas"], h["reason"]) for h in status["history"]]
    assert history[0] == (1, 1, "[MetricsUnavailable] hold: no data yet for generationTokenRate")
    assert history[1][:2] == (1, 4) and history[1][2].startswith("panic: generationTokenRate")
    conditions = {c["type"]: c for c in cluster.infd["status"]["conditions"]}
    assert conditions["Ready"] == {"type": "Ready", "status": "True"}  # others' untouched
    assert conditions["ScalingLimited"]["status"] == "False"
    assert conditions["ScalingLimited"]["observedGeneration"] == 3


async def test_state_in_status_carries_over_a_restart() -> None:
    cluster = FakeCluster(SPEC, 1, [pod("p1", "127.1.0.2")])
    async with engines({"127.1.0.2": metrics(0.0)}) as http:
        await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    # A new operator process: nothing in memory, only what is in status.
    async with engines({"127.1.0.2": metrics(2000.0)}) as http:
        decision, _ = await autoscale_once(cluster, http, NS, NAME, T0 + 5)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 4


async def test_unreachable_engines_hold_and_report() -> None:
    cluster = FakeCluster(SPEC, 3, [pod(f"p{i}", f"127.1.0.{i}") for i in range(3)])
    async with engines({}) as http:
        decision, _ = await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 3
    assert not [w for w in cluster.writes if w[0] == "scale"]
    limited = {c["type"]: c for c in cluster.infd["status"]["conditions"]}["ScalingLimited"]
    assert (limited["status"], limited["reason"]) == ("True", "MetricsUnavailable")


async def test_a_nan_or_infinite_gauge_is_no_data_not_zero_load() -> None:
    """An exporter that writes NaN (or +Inf) into a gauge the targets read: the fleet holds and
    says the metrics are unavailable; it neither drains a replica (NaN read as 0) nor stops
    deciding (an exception every tick)."""
    spec = {**SPEC, "targets": {"kvCacheUtilization": 0.8}}
    for bad in ("NaN", "+Inf"):
        cluster = FakeCluster(spec, 3, [pod(f"p{i}", f"127.1.0.{i}") for i in range(3)])
        texts = {f"127.1.0.{i}": metrics(0.0, kv=bad) for i in range(3)}  # type: ignore[arg-type]
        async with engines(texts) as http:
            decision, _ = await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
        assert decision is not None and decision.desired_replicas == 3
        assert not [w for w in cluster.writes if w[0] == "scale"]
        conditions = {c["type"]: c for c in cluster.infd["status"]["conditions"]}
        assert conditions["ScalingLimited"]["reason"] == "MetricsUnavailable"


async def test_unschedulable_pod_sets_insufficient_capacity() -> None:
    pods = [pod("p1", "127.1.0.2"), pod("p2", "", ready=False, unschedulable=True)]
    cluster = FakeCluster(SPEC, 2, pods)
    for now, generated in ((T0, 0.0), (T0 + 5, 5000.0)):
        async with engines({"127.1.0.2": metrics(generated)}) as http:
            decision, _ = await autoscale_once(cluster, http, NS, NAME, now)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 2
    limited = {c["type"]: c for c in cluster.infd["status"]["conditions"]}["ScalingLimited"]
    assert (limited["status"], limited["reason"]) == ("True", "InsufficientCapacity")


async def test_scale_down_marks_the_idle_pod_for_deletion() -> None:
    pods = [pod("busy", "127.1.0.2"), pod("idle", "127.1.0.3")]
    cluster = FakeCluster(SPEC, 2, pods)
    for now in (T0, T0 + 5):
        bodies = {"127.1.0.2": metrics(100.0, running=2), "127.1.0.3": metrics(100.0)}
        async with engines(bodies) as http:
            decision, _ = await autoscale_once(cluster, http, NS, NAME, now)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 1
    applied = [w[1] for w in cluster.writes if w[0] == "apply"]
    assert applied == [
        (
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "idle",
                    "namespace": NS,
                    "annotations": {DELETION_COST: "-1000"},
                },
            },
            "kvfleet-autoscaler",
        )
    ]
    assert cluster.writes.index(("scale", 1)) > cluster.writes.index(("apply", applied[0]))


async def test_other_controllers_and_suspended_objects_are_left_alone() -> None:
    hpa = {**SPEC, "controller": "HPA"}
    cluster = FakeCluster(hpa, 2, [pod("p1", "127.1.0.2")])
    async with engines({}) as http:
        decision, _ = await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    assert decision is None and cluster.writes == []


async def test_switch_back_to_builtin_deletes_the_hpa_it_rendered() -> None:
    cluster = FakeCluster(SPEC, 1, [pod("p1", "127.1.0.2")])
    owned = {"metadata": {"ownerReferences": [{"uid": "u1"}]}}
    cluster.external = {"HorizontalPodAutoscaler": owned, "ScaledObject": {"metadata": {}}}
    async with engines({"127.1.0.2": metrics(0.0)}) as http:
        await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    assert ("delete", "HorizontalPodAutoscaler") in cluster.writes
    assert ("delete", "ScaledObject") not in cluster.writes  # not ours: left alone


async def test_condition_is_written_only_when_it_changes_and_never_over_a_newer_status() -> None:
    cluster = FakeCluster(SPEC, 3, [pod(f"p{i}", f"127.1.0.{i}") for i in range(3)])
    async with engines({}) as http:
        await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
        condition_writes = [w for w in cluster.writes if w[0] == "status" and "conditions" in w[1]]
        assert len(condition_writes) == 1
        await autoscale_once(cluster, http, NS, NAME, T0 + 1)  # type: ignore[arg-type]
    condition_writes = [w for w in cluster.writes if w[0] == "status" and "conditions" in w[1]]
    assert len(condition_writes) == 1  # unchanged: not written again

    # The reconciler changes conditions between the autoscaler's read and write: 409, skipped.
    cluster.infd["status"]["conditions"] = []
    original = cluster.patch_status

    async def racing(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        if "autoscaling" in args[4]:
            cluster.bump()  # someone else wrote in between
        return result

    cluster.patch_status = racing  # type: ignore[method-assign]
    async with engines({}) as http:
        await autoscale_once(cluster, http, NS, NAME, T0 + 2)  # type: ignore[arg-type]
    assert cluster.infd["status"]["conditions"] == []


async def test_state_of_a_deleted_pod_does_not_linger_in_status() -> None:
    cluster = FakeCluster(SPEC, 2, [pod("p1", "127.1.0.2"), pod("p2", "127.1.0.3")])
    bodies = {"127.1.0.2": metrics(0.0), "127.1.0.3": metrics(0.0)}
    async with engines(bodies) as http:
        await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
        cluster.pods = cluster.pods[:1]
        await autoscale_once(cluster, http, NS, NAME, T0 + 1)  # type: ignore[arg-type]
    # Status is written by JSON merge patch: the saved state must name only pods that exist.
    snapshots = cluster.infd["status"]["autoscaling"]["state"]["snapshots"]
    assert [entry[0] for entry in snapshots] == ["p1"]


async def test_prometheus_source_reads_the_same_series_per_pod() -> None:
    from kvfleet_operator.autoscaling.pods import pod_facts
    from kvfleet_operator.autoscaling.sources import query_prometheus

    def series(name: str, pod_name: str, value: float, age: float = 2) -> dict[str, Any]:
        # A matrix: each series' raw samples, oldest first, with their scrape times.
        metric = {"__name__": name, "namespace": NS, "pod": pod_name}
        return {"metric": metric, "values": [[T0 - age - 15, "1"], [T0 - age, str(value)]]}

    result = [
        series("kvfleet_generation_tokens_total", "p1", 500),
        series("kvfleet_prompt_tokens_total", "p1", 900),
        series("kvfleet_kv_cache_usage_ratio", "p1", 0.25),
        series("kvfleet_requests_waiting", "p1", 1),
        series("kvfleet_requests_running", "p1", 3),
        series("kvfleet_engine_capacity_tokens_per_second", "p1", 400),
        series("kvfleet_generation_tokens_total", "p2", 7),  # incomplete: no gauges
        # p3's scrapes stopped 90 s ago: its last values are no data, not a frozen counter.
        *(series(name, "p3", 1, age=90) for name in (
            "kvfleet_generation_tokens_total", "kvfleet_prompt_tokens_total",
            "kvfleet_kv_cache_usage_ratio", "kvfleet_requests_waiting",
        )),
    ]  # fmt: skip
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200, json={"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    pods = [pod_facts(pod(f"p{i}", f"127.1.0.{i + 1}")) for i in (1, 2, 3)]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        samples = await query_prometheus(http, "http://prom:9090/", NS, pods, T0)  # type: ignore[arg-type]
    query = seen[0].url.params["query"]
    assert seen[0].url.path == "/api/v1/query"
    assert f'namespace="{NS}"' in query and 'pod=~"p1|p2|p3"' in query
    assert query.endswith("}[120s]")  # raw samples with their scrape times
    p1 = samples["p1"]
    assert p1 is not None and p1.time == T0 - 2
    assert (p1.generation_tokens_total, p1.kv_cache_usage, p1.in_flight) == (500, 0.25, 4)
    assert p1.capacity_generation == 400
    assert samples["p2"] is None  # missing series: no data, never zeros
    assert samples["p3"] is None  # stale series: no data, never a rate of zero


async def test_statefulset_groups_scale_by_their_leaders_metrics() -> None:
    """Replicas are groups: only leaders (pod index 0) are scraped, the count of StatefulSets is
    the current replicas, and the desired count goes to status for the reconciler to render."""
    cluster = FakeCluster(SPEC, 1, [pod("llama-group-0-0", "127.1.0.2")])
    cluster.deployment = None
    cluster.statefulsets = [{"metadata": {"name": "llama-group-0", "ownerReferences": [OWNER]}}]
    cluster.pod_selector = f"kvfleet.io/deployment={NAME},apps.kubernetes.io/pod-index=0"
    decision = None
    for now, generated in ((T0, 0.0), (T0 + 5, 1000.0)):  # 200 tok/s on one group
        async with engines({"127.1.0.2": metrics(generated)}) as http:
            decision, _ = await autoscale_once(cluster, http, NS, NAME, now)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 2
    assert not [w for w in cluster.writes if w[0] in ("scale", "apply")]
    status = cluster.infd["status"]["autoscaling"]
    assert (status["currentReplicas"], status["desiredReplicas"]) == (1, 2)
    assert ("event", "ScaledUp") in cluster.writes


class _FailingCluster(FakeCluster):
    """Its first read fails as given; the stop flag is set on the second."""

    def __init__(self, error: Exception, stop: Any) -> None:
        super().__init__(SPEC, 1, [pod("p1", "127.1.0.2")])
        self.error, self.stop, self.reads = error, stop, 0

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None):
        self.reads += 1
        if self.reads == 1:
            raise self.error
        self.stop.set()
        return await super().get(api_version, kind, name, namespace)


async def test_a_failed_tick_is_one_warning_line_and_the_next_tick_runs(caplog) -> None:
    from kvfleet_operator.autoscaling.autoscaler import run_autoscaler
    from kvfleet_operator.loops import Flag

    body = '{"kind": "Status", "message": "etcdserver: leader changed"}'
    error = ApiException(status=503, reason="Service Unavailable")
    error.body, error.headers = body, {"Audit-Id": "x" * 200}
    stop = Flag()
    cluster = _FailingCluster(error, stop)
    # The idle period (5 s) until the retry, cut short: the flag's wait returns at once.
    stop.wait = _no_wait  # type: ignore[method-assign]
    await run_autoscaler(cluster, NS, NAME, stop)  # type: ignore[arg-type]
    assert cluster.reads >= 2, "the tick after the failure did not run"
    (record,) = [r for r in caplog.records if r.name.endswith("autoscaler")]
    assert record.levelname == "WARNING" and record.exc_info is None
    assert record.getMessage() == (
        f"autoscaling {NS}/{NAME} failed (503 Service Unavailable: etcdserver: leader changed); "
        "retrying in 5 s"
    )


async def test_an_unexpected_error_keeps_its_traceback(caplog) -> None:
    from kvfleet_operator.autoscaling.autoscaler import run_autoscaler
    from kvfleet_operator.loops import Flag

    stop = Flag()
    stop.wait = _no_wait  # type: ignore[method-assign]
    await run_autoscaler(_FailingCluster(KeyError("spec"), stop), NS, NAME, stop)  # type: ignore[arg-type]
    (record,) = [r for r in caplog.records if r.name.endswith("autoscaler")]
    assert record.levelname == "ERROR" and record.exc_info is not None


async def _no_wait(timeout: float | None = None) -> bool:
    return True
