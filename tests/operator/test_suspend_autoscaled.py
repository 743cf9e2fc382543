"""spec.suspend on an InferenceDeployment whose replicas HPA or KEDA own: the workload is held at
zero without a fight, and resuming gives the autoscaler a count it acts on."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_reconcile import LLAMA_405B, TWO_NODES, MemoryCluster, infd

from kvfleet_operator import api
from kvfleet_operator.accelerators import resolve_accelerator
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.model_catalog import model_architecture
from kvfleet_operator.plan import ClusterFeatures, plan_deployment
from kvfleet_operator.reconcile import reconcile
from kvfleet_operator.render import render_children

KEDA = {
    "controller": "KEDA",
    "minReplicas": 1,
    "maxReplicas": 4,
    "prometheus": {"url": "http://prometheus.monitoring:9090"},
    "targets": {"kvCacheUtilization": 0.8},
}
HPA = {"controller": "HPA", "minReplicas": 2, "maxReplicas": 4,
       "targets": {"kvCacheUtilization": 0.7}}  # fmt: skip
PAUSED_REPLICAS = "autoscaling.keda.sh/paused-replicas"


def rendered(make_spec, **override: Any) -> dict[str, dict[str, Any]]:
    spec = make_spec(**override)
    profile = resolve_accelerator(spec.resources.accelerator, {})
    features = ClusterFeatures(leader_worker_set=True, service_monitor=False, keda=True)
    plan = plan_deployment("llama", spec, profile, model_architecture(spec.model), features)
    assert plan.ok, plan.problems
    children = render_children("llama", "ns", spec, plan, profile, service_monitor=False)
    return {child["kind"]: child for child in children if child["metadata"]["name"] == "llama"
            or child["kind"] == "LeaderWorkerSet"}  # fmt: skip


@pytest.mark.parametrize("workload", ["Deployment", "LeaderWorkerSet"])
def test_a_suspended_keda_deployment_holds_its_scaled_object_at_zero(make_spec, workload) -> None:
    """KEDA scales a target below minReplicaCount back up to it, and the reconciler set it back
    to 0 on every pass (its children's events trigger the next): the engines started and were
    killed over and over. Paused at 0 replicas, KEDA agrees with the reconciler."""
    group = {"model": LLAMA_405B, "parallelism": TWO_NODES} if workload != "Deployment" else {}
    objects = rendered(make_spec, replicas=None, autoscaling=KEDA, suspend=True, **group)
    assert objects[workload]["spec"]["replicas"] == 0
    scaled = objects["ScaledObject"]
    assert scaled["metadata"]["annotations"] == {PAUSED_REPLICAS: "0"}
    assert scaled["spec"]["scaleTargetRef"]["kind"] == workload

    resumed = rendered(make_spec, replicas=None, autoscaling=KEDA, **group)
    assert "annotations" not in resumed["ScaledObject"]["metadata"]  # KEDA scales again
    assert "replicas" not in resumed[workload]["spec"]


class ReplicasOwnership(MemoryCluster):
    """MemoryCluster whose spec.replicas follows server-side apply: a forced apply takes the
    field (a manager that applied another value loses it, one that applied the same value
    shares it), an apply without it gives up the manager's share, and a field nobody owns is
    removed (a Deployment then has 1 replica). managedFields name the owners."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: dict[tuple[str, str, str], set[str]] = {}

    def _own(self, key: tuple[str, str, str], manager: str, value: int | None) -> int | None:
        owners = self.owners.setdefault(key, set())
        current = (self.objects.get(key) or {}).get("spec", {}).get("replicas")
        if value is None:
            owners.discard(manager)
            return current if owners else None
        if value != current:
            owners.clear()
        owners.add(manager)
        return value

    def _store(self, key: tuple[str, str, str], replicas: int | None) -> dict[str, Any]:
        obj = self.objects[key]
        if "spec" not in obj:  # a ServiceAccount
            return copy.deepcopy(obj)
        obj["spec"].pop("replicas", None)
        if replicas is not None:
            obj["spec"]["replicas"] = replicas
        obj["metadata"]["managedFields"] = [
            {"manager": m, "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}}
            for m in sorted(self.owners[key])
        ]
        return copy.deepcopy(obj)

    async def apply(self, manifest, *, owner=None, field_manager=api.FIELD_MANAGER):
        meta = manifest["metadata"]
        key = (manifest["kind"], meta["namespace"], meta["name"])
        replicas = self._own(key, field_manager, manifest.get("spec", {}).get("replicas"))
        await super().apply(manifest, owner=owner, field_manager=field_manager)
        return self._store(key, replicas)

    async def scale(self, namespace, name, replicas, *, field_manager=api.AUTOSCALER_FIELD_MANAGER,
                    api_version="apps/v1", kind="Deployment"):  # fmt: skip
        key = (kind, namespace, name)
        return self._store(key, self._own(key, field_manager, replicas))


async def test_resuming_under_an_hpa_hands_it_at_least_min_replicas() -> None:
    """An HPA leaves a target at zero replicas alone (ScalingActive=False, ScalingDisabled).
    Resuming handed it the suspended count, 0: the deployment stayed at zero replicas for
    good. Now the autoscaler's field manager takes over minReplicas, which the HPA scales on."""
    cluster = ReplicasOwnership()
    cluster.add(infd(autoscaling=HPA, routing={"enabled": False}))
    body = cluster.objects[("InferenceDeployment", "ns", "llama")]
    await reconcile(cluster, "ns", "llama", HeaderCache())

    def replicas() -> int:
        return int(cluster.objects[("Deployment", "ns", "llama")]["spec"].get("replicas", 1))

    await cluster.scale("ns", "llama", 3, field_manager="kube-controller-manager")  # the HPA
    for generation, suspend in ((2, True), (3, False)):
        body["spec"]["suspend"] = suspend
        body["metadata"]["generation"] = generation
        await reconcile(cluster, "ns", "llama", HeaderCache())
        if suspend:
            assert replicas() == 0
            assert "HorizontalPodAutoscaler" in {kind for kind, _, _ in cluster.objects}
    assert replicas() == 2  # minReplicas: the HPA's to scale from here
    assert cluster.owners[("Deployment", "ns", "llama")] == {api.AUTOSCALER_FIELD_MANAGER}
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    assert status["scaling"] == "Auto(2-4)"


@pytest.mark.parametrize(
    "changes",
    [
        # Suspended (the reconciler's 0 joins the autoscaler's: both own it), then resumed
        # under an HPA: the autoscaler's field manager already owning replicas, nothing was
        # handed.
        [{"suspend": True}, {"suspend": False, "autoscaling": HPA}],
        # Handed straight to an HPA: the reconciler did not own replicas, nothing was handed.
        [{"autoscaling": HPA}],
    ],
    ids=["suspended-then-resumed", "switched"],
)
async def test_builtin_at_zero_handed_to_an_hpa_gets_min_replicas(changes) -> None:
    """Builtin (minReplicas 0) had scaled to zero, then an HPA takes over. An HPA never scales
    a target at zero: the Deployment stayed at 0 for good."""
    cluster = ReplicasOwnership()
    builtin = {"minReplicas": 0, "maxReplicas": 4,
               "targets": {"generationTokenRate": {"tokensPerSecond": 100}}}  # fmt: skip
    cluster.add(infd(autoscaling=builtin))
    body = cluster.objects[("InferenceDeployment", "ns", "llama")]
    await reconcile(cluster, "ns", "llama", HeaderCache())
    await cluster.scale("ns", "llama", 0)  # the Builtin autoscaler, idle
    for generation, change in enumerate(changes, start=2):
        body["spec"].update(change)
        body["metadata"]["generation"] = generation
        await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.objects[("Deployment", "ns", "llama")]["spec"]["replicas"] == 2
    assert cluster.owners[("Deployment", "ns", "llama")] == {api.AUTOSCALER_FIELD_MANAGER}
