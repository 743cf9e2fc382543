"""Two writers of one InferenceDeployment's status: the reconciler and the Builtin autoscaler.
Status is merge-patched, so fields a writer leaves out are kept; but `conditions` is one list a
patch replaces whole, and status.autoscaling is the autoscaler's while the reconciler clears it.
Neither writer may put back, from a stale read, what the other has just written."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import httpx
from kubernetes_asyncio.client.exceptions import ApiException
from test_reconcile import MemoryCluster, conflict, infd

from kvfleet_operator import api
from kvfleet_operator.apply import with_owner
from kvfleet_operator.autoscaling.autoscaler import autoscale_once
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.reconcile import reconcile
from status_patch import merge_patch

NS, NAME = "ns", "llama"
T0 = 1_700_000_000.0  # after the pods became ready (2020)
BUILTIN = {
    "minReplicas": 1,
    "maxReplicas": 5,
    "targets": {"generationTokenRate": {"tokensPerSecond": 100}},
    "behavior": {"warmupSeconds": 0, "scaleDown": {"stabilizationWindowSeconds": 0}},
}


def engine_metrics(generated: float, running: float = 0) -> str:
    return (
        f'kvfleet_generation_tokens_total{{model_name="m"}} {generated}\n'
        f'kvfleet_prompt_tokens_total{{model_name="m"}} {generated}\n'
        'kvfleet_kv_cache_usage_ratio{model_name="m"} 0.1\n'
        'kvfleet_requests_waiting{model_name="m"} 0\n'
        f'kvfleet_requests_running{{model_name="m"}} {running}\n'
        'kvfleet_engine_capacity_tokens_per_second{model_name="m"} 400\n'
    )


def engine_pod(name: str, ip: str) -> dict[str, Any]:
    ready = {"type": "Ready", "status": "True", "lastTransitionTime": "2020-01-01T00:00:00Z"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}",
                     "labels": {api.DEPLOYMENT_LABEL: NAME}},
        "status": {"podIP": ip, "phase": "Running", "conditions": [ready]},
    }  # fmt: skip


class TickCluster:
    """The subset of apply.Cluster the autoscaler's tick uses, answering as the API server
    does where it matters: every write moves the InferenceDeployment's resourceVersion, and a
    status patch conditional on an older one is a 409; server-side apply to a pod that is gone
    creates it (a pod with no containers: 422) unless the manifest names a uid (409)."""

    def __init__(self, replicas: int, pods: list[dict[str, Any]]) -> None:
        self.infd = infd(autoscaling=BUILTIN)
        self.infd["metadata"]["resourceVersion"] = "1"
        owner = with_owner({"metadata": {}}, self.infd)["metadata"]["ownerReferences"]
        self.deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                           "metadata": {"name": NAME, "namespace": NS, "ownerReferences": owner},
                           "spec": {"replicas": replicas}}  # fmt: skip
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.events: list[str] = []

    def write_status(self, patch: dict[str, Any]) -> None:
        """A status write, by this fake's callers or another writer."""
        self.infd["status"] = merge_patch(self.infd.get("status", {}), patch)
        meta = self.infd["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None):
        found = {"InferenceDeployment": self.infd, "Deployment": self.deployment}.get(kind)
        return copy.deepcopy(found)

    async def list(self, api_version: str, kind: str, namespace=None, selector: str = ""):
        return [copy.deepcopy(p) for p in self.pods.values()] if kind == "Pod" else []

    async def scale(self, namespace, name, replicas, *, field_manager="", api_version="apps/v1",
                    kind="Deployment"):  # fmt: skip
        self.deployment["spec"]["replicas"] = replicas
        return copy.deepcopy(self.deployment)

    async def apply(self, manifest: dict[str, Any], *, owner=None, field_manager=""):
        meta = manifest["metadata"]
        pod = self.pods.get(meta["name"])
        if pod is None:
            if "uid" in meta:
                raise conflict()  # uid mismatch: no existing object was found
            raise ApiException(status=422, reason="Unprocessable Entity")  # no containers
        if meta.get("uid", pod["metadata"]["uid"]) != pod["metadata"]["uid"]:
            raise conflict()
        pod["metadata"]["annotations"] = dict(meta.get("annotations", {}))
        return copy.deepcopy(pod)

    async def patch_status(self, api_version, kind, name, namespace, status, *,
                           resource_version=None):  # fmt: skip
        if resource_version not in (None, self.infd["metadata"]["resourceVersion"]):
            raise conflict()
        self.write_status(status)
        return copy.deepcopy(self.infd)

    async def post_event(self, involved, type_, reason, message, *, name=None) -> None:
        self.events.append(reason)

    async def delete(self, api_version, kind, name, namespace=None, *, propagation=None):
        return False


def engines(cluster: TickCluster, bodies: dict[str, str], meanwhile: Callable[[], None]):
    """The engines' /metrics; `meanwhile` runs once, while the tick scrapes them: what another
    writer does between the tick's reads and its writes."""
    done = []

    def handle(request: httpx.Request) -> httpx.Response:
        response = httpx.Response(200, text=bodies[request.url.host])
        if not done:
            done.append(meanwhile())
        return response

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_a_tick_that_began_before_autoscaling_was_turned_off_writes_no_status() -> None:
    """The reconciler clears status.autoscaling when spec.autoscaling goes. A tick that read the
    object before wrote it back, ScalingLimited with it, both wrong until the next resync."""
    cluster = TickCluster(1, [engine_pod("p1", "127.1.0.2")])

    def fixed_replicas_now() -> None:
        cluster.infd["spec"] = infd(replicas=1)["spec"]
        cluster.infd["metadata"]["generation"] = 2
        cluster.write_status({"autoscaling": None, "observedGeneration": 2})

    async with engines(cluster, {"127.1.0.2": engine_metrics(0.0)}, fixed_replicas_now) as http:
        await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    status = cluster.infd["status"]
    assert "autoscaling" not in status and "conditions" not in status, status


async def test_a_tick_writes_its_status_over_another_writers_change() -> None:
    """A conflict with a write that leaves autoscaling on (here the reconciler's
    readyReplicas) only makes the tick write on the newer version: nothing is lost."""
    cluster = TickCluster(1, [engine_pod("p1", "127.1.0.2")])

    def reconciler_writes() -> None:
        cluster.write_status({"readyReplicas": 1})

    async with engines(cluster, {"127.1.0.2": engine_metrics(0.0)}, reconciler_writes) as http:
        await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    status = cluster.infd["status"]
    assert status["readyReplicas"] == 1 and status["autoscaling"]["desiredReplicas"] == 1
    limited = {c["type"]: c for c in status["conditions"]}["ScalingLimited"]
    assert (limited["status"], limited["reason"]) == ("True", "MetricsUnavailable")


async def test_the_reconciler_keeps_the_condition_the_autoscaler_wrote_during_its_pass() -> None:
    """The reconciler wrote the conditions list it had read at the start of its pass, with its
    own conditions updated: a ScalingLimited the autoscaler set meanwhile was put back to the
    old one until the autoscaler's next tick."""

    class Concurrent(MemoryCluster):
        ticked = False

        async def apply(self, manifest: dict[str, Any], *, owner=None, field_manager=""):
            if not self.ticked:  # the autoscaler's tick, during the reconciler's pass
                self.ticked = True
                body = self.objects[("InferenceDeployment", NS, NAME)]
                limited = {"type": "ScalingLimited", "status": "True", "reason": "DesiredAboveMax"}
                conditions = [*body.get("status", {}).get("conditions", []), limited]
                await self.patch_status(
                    api.API_VERSION, api.INFERENCE_DEPLOYMENT, NAME, NS,
                    {"conditions": conditions},
                    resource_version=body["metadata"]["resourceVersion"],
                )  # fmt: skip
            return await super().apply(manifest, owner=owner, field_manager=field_manager)

    cluster = Concurrent()
    cluster.add(infd(autoscaling=BUILTIN, routing={"enabled": False}))
    await reconcile(cluster, NS, NAME, HeaderCache())  # type: ignore[arg-type]
    status = cluster.objects[("InferenceDeployment", NS, NAME)]["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["ScalingLimited"]["reason"] == "DesiredAboveMax"
    assert conditions["Ready"]["reason"] == "RollingOut" and status["observedGeneration"] == 1
    assert cluster.events == ["Created"], "told once, not once per try"


async def test_a_tick_writes_nothing_on_an_object_created_anew_under_its_name() -> None:
    """Deleted and created again (another uid) during the tick: the old object's decision is
    not written on the new one after the conflict (it had been, until the next tick)."""
    cluster = TickCluster(1, [engine_pod("p1", "127.1.0.2")])

    def created_anew() -> None:
        cluster.infd = infd(autoscaling={**BUILTIN, "minReplicas": 3, "maxReplicas": 5})
        cluster.infd["metadata"].update(uid="u-2", resourceVersion="7")

    async with engines(cluster, {"127.1.0.2": engine_metrics(0.0)}, created_anew) as http:
        await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    assert "status" not in cluster.infd, cluster.infd["status"]
