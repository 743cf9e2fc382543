"""A LeaderWorkerSet whose group size (nodes per replica) changes: LeaderWorkerSet releases before
0.7 refuse the change in their webhook, later ones roll the groups to the new size."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from test_reconcile import LLAMA_405B, TWO_NODES, MemoryCluster, infd
from test_suspend_autoscaled import ReplicasOwnership

from kvfleet_operator import api
from kvfleet_operator.handover import RECREATING_REPLICAS
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.reconcile import reconcile

FOUR_NODES = {"tensor": 8, "pipeline": 4}  # 32 GPUs: four nodes of eight
LWS = ("LeaderWorkerSet", "ns", "llama-group")


def refusal(status: int, message: str) -> ApiException:
    error = ApiException(status=status, reason="Forbidden" if status == 403 else "Invalid")
    error.body = json.dumps({"message": message})
    return error


class LeaderWorkerSets(MemoryCluster):
    """MemoryCluster with the LeaderWorkerSet API: its validating webhook (of releases before
    0.7 unless `size_mutable`: spec.leaderWorkerTemplate.size is immutable; controller-runtime
    denies with 403), another admission webhook's refusal when `policy` says one, and foreground
    deletion (the object stays, with a deletionTimestamp, until `collect_garbage`)."""

    def __init__(self, *, size_mutable: bool = False, policy: str | None = None) -> None:
        super().__init__()
        self.leader_worker_set = True
        self.size_mutable = size_mutable
        self.policy = policy
        self.propagation: list[str | None] = []

    async def apply(self, manifest: dict[str, Any], *, owner=None, field_manager=""):
        stored = self.objects.get(LWS)
        if manifest["kind"] == "LeaderWorkerSet" and stored is not None:
            if self.policy is not None:
                raise refusal(403, f'admission webhook "policy.example" denied: {self.policy}')
            size = manifest["spec"]["leaderWorkerTemplate"]["size"]
            if not self.size_mutable and size != stored["spec"]["leaderWorkerTemplate"]["size"]:
                raise refusal(
                    403,
                    'admission webhook "vleaderworkerset.kb.io" denied the request: '
                    f"spec.leaderWorkerTemplate.size: Invalid value: {size}: field is immutable",
                )
            if stored["metadata"].get("deletionTimestamp"):
                manifest = copy.deepcopy(manifest)  # apply keeps what deletion set
                manifest["metadata"]["deletionTimestamp"] = stored["metadata"]["deletionTimestamp"]
        return await super().apply(manifest, owner=owner, field_manager=field_manager)

    async def delete(self, api_version, kind, name, namespace=None, *, propagation=None):
        self.propagation.append(propagation)
        if propagation != "Foreground" or (kind, namespace, name) not in self.objects:
            return await super().delete(api_version, kind, name, namespace)
        self.deleted.append(f"{kind}/{name}")
        meta = self.objects[(kind, namespace, name)]["metadata"]
        meta.setdefault("deletionTimestamp", "2026-12-06T00:00:00Z")
        meta["finalizers"] = ["foregroundDeletion"]
        return True

    def collect_garbage(self) -> None:
        """The groups' StatefulSets and pods are gone: so is the LeaderWorkerSet."""
        if self.objects.get(LWS, {}).get("metadata", {}).get("deletionTimestamp"):
            del self.objects[LWS]


async def grow_to_four_nodes(cluster: LeaderWorkerSets) -> dict[str, Any]:
    """Two groups of two nodes, then four nodes per group (generation 2)."""
    cluster.add(infd(replicas=2, model=LLAMA_405B, parallelism=TWO_NODES))
    await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.objects[LWS]["spec"]["leaderWorkerTemplate"]["size"] == 2
    body = cluster.objects[("InferenceDeployment", "ns", "llama")]
    body["spec"]["parallelism"] = FOUR_NODES
    body["metadata"]["generation"] = 2
    return body


def conditions(cluster: MemoryCluster) -> dict[str, dict[str, Any]]:
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    return {c["type"]: c for c in status["conditions"]}


async def test_a_size_the_leader_worker_set_cannot_change_recreates_it() -> None:
    """Before, every pass was refused (403, ApplyRejected) and the new size never ran. Now the
    LeaderWorkerSet is deleted with its groups (foreground) and created again once gone."""
    cluster = LeaderWorkerSets()
    await grow_to_four_nodes(cluster)
    await reconcile(cluster, "ns", "llama", HeaderCache())
    lws = cluster.objects[LWS]
    assert lws["metadata"]["deletionTimestamp"] and cluster.propagation == ["Foreground"]
    assert cluster.events[-1] == "RecreatingLeaderWorkerSet"
    assert conditions(cluster)["Stalled"]["status"] == "False"
    assert conditions(cluster)["Planned"]["message"].startswith("4 pod(s)")

    # While its groups are deleted, passes leave it alone and tell nothing more.
    events = list(cluster.events)
    await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.objects[LWS]["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert cluster.events == events and cluster.propagation == ["Foreground"]

    cluster.collect_garbage()
    await reconcile(cluster, "ns", "llama", HeaderCache())
    lws = cluster.objects[LWS]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 4
    assert "deletionTimestamp" not in lws["metadata"] and lws["spec"]["replicas"] == 2
    assert cluster.events[-1] == "Created"
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    assert status["topology"]["nodesPerReplica"] == 4


async def test_a_leader_worker_set_that_resizes_in_place_is_not_recreated() -> None:
    """LeaderWorkerSet 0.7 and later take the new size and roll the groups themselves."""
    cluster = LeaderWorkerSets(size_mutable=True)
    await grow_to_four_nodes(cluster)
    await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.objects[LWS]["spec"]["leaderWorkerTemplate"]["size"] == 4
    assert cluster.deleted == [] and cluster.events[-1] == "RolloutStarted"


async def test_another_refusal_deletes_nothing() -> None:
    """A refusal that is not about the size (here a policy webhook) is reported as before:
    deleting the running groups would not make the new spec pass."""
    cluster = LeaderWorkerSets(policy="team-a may not use 32 GPUs")
    await grow_to_four_nodes(cluster)
    with pytest.raises(ApiException):
        await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.deleted == [] and "RecreatingLeaderWorkerSet" not in cluster.events
    stalled = conditions(cluster)["Stalled"]
    assert (stalled["status"], stalled["reason"]) == ("True", "ApplyRejected")
    assert "team-a may not use 32 GPUs" in stalled["message"]


async def test_a_policy_that_names_the_size_field_deletes_nothing() -> None:
    """A policy webhook that caps the group size names the field too; only the LeaderWorkerSet
    webhook's "field is immutable" is a size that cannot change in place. Deleting the running
    groups for a size the cluster refuses left the deployment with no replica at all."""
    cluster = LeaderWorkerSets(policy="spec.leaderWorkerTemplate.size: at most 2 nodes per replica")
    await grow_to_four_nodes(cluster)
    with pytest.raises(ApiException):
        await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.deleted == [] and "RecreatingLeaderWorkerSet" not in cluster.events
    assert "deletionTimestamp" not in cluster.objects[LWS]["metadata"]
    stalled = conditions(cluster)["Stalled"]
    assert (stalled["status"], stalled["reason"]) == ("True", "ApplyRejected")


class AutoscaledLeaderWorkerSets(LeaderWorkerSets, ReplicasOwnership):
    """LeaderWorkerSets whose spec.replicas follows server-side apply's owners."""

    async def apply(self, manifest, *, owner=None, field_manager=api.FIELD_MANAGER):
        return await super().apply(manifest, owner=owner, field_manager=field_manager)

    def collect_garbage(self) -> None:
        super().collect_garbage()
        self.owners.pop(LWS, None)  # a new object: no owners yet


async def autoscaled_at_three_then_four_nodes(
    cluster: AutoscaledLeaderWorkerSets, controller: str = "HPA"
) -> dict[str, Any]:
    """Two-node groups an autoscaler scaled to 3, then four nodes per group (generation 2)."""
    auto = {"controller": controller, "minReplicas": 1, "maxReplicas": 4,
            "targets": {"kvCacheUtilization": 0.8}}  # fmt: skip
    cluster.add(infd(model=LLAMA_405B, parallelism=TWO_NODES, autoscaling=auto))
    await reconcile(cluster, "ns", "llama", HeaderCache())
    await reconcile(cluster, "ns", "llama", HeaderCache())  # handed to the autoscaler
    await cluster.scale("ns", "llama-group", 3, api_version=api.LEADER_WORKER_SET_API,
                        kind="LeaderWorkerSet")  # fmt: skip
    body = cluster.objects[("InferenceDeployment", "ns", "llama")]
    body["spec"]["parallelism"] = FOUR_NODES
    body["metadata"]["generation"] = 2
    return body


@pytest.mark.parametrize("controller", ["Builtin", "HPA"])
async def test_a_recreated_leader_worker_set_keeps_the_autoscalers_replicas(controller) -> None:
    """Under autoscaling the rendered LeaderWorkerSet has no spec.replicas. Before, the one
    created again after a group-size change started at the API server's default, 1 group of
    the 3 the autoscaler had asked for, until it scaled up again. Now it starts at 3, and the
    autoscaler owns the count again from the next pass."""
    cluster = AutoscaledLeaderWorkerSets()
    body = await autoscaled_at_three_then_four_nodes(cluster, controller)

    await reconcile(cluster, "ns", "llama", HeaderCache())  # refused: deleted, 3 recorded
    assert cluster.events[-1] == "RecreatingLeaderWorkerSet"
    assert body["status"][RECREATING_REPLICAS] == 3
    await reconcile(cluster, "ns", "llama", HeaderCache())  # its groups still going
    cluster.collect_garbage()
    await reconcile(cluster, "ns", "llama", HeaderCache())
    lws = cluster.objects[LWS]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 4 and lws["spec"]["replicas"] == 3
    assert body["status"].get(RECREATING_REPLICAS) is None  # cleared by the merge patch

    await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.owners[LWS] == {api.AUTOSCALER_FIELD_MANAGER}
    assert cluster.objects[LWS]["spec"]["replicas"] == 3


class FailingServices(AutoscaledLeaderWorkerSets):
    """The API server fails the Services' applies (500) while `failing`."""

    failing = False

    async def apply(self, manifest, *, owner=None, field_manager=api.FIELD_MANAGER):
        if self.failing and manifest["kind"] == "Service":
            raise ApiException(status=500, reason="Internal Server Error")
        return await super().apply(manifest, owner=owner, field_manager=field_manager)


async def test_the_count_outlives_a_pass_that_fails_after_the_deletion() -> None:
    """The count is written before the LeaderWorkerSet is deleted: a pass that fails after
    (a 500 on a later child, the operator killed) must not create it again at 1."""
    cluster = FailingServices()
    body = await autoscaled_at_three_then_four_nodes(cluster)
    cluster.failing = True
    with pytest.raises(ApiException):
        await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.objects[LWS]["metadata"]["deletionTimestamp"]
    assert body["status"][RECREATING_REPLICAS] == 3
    cluster.failing = False
    cluster.collect_garbage()
    await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.objects[LWS]["spec"]["replicas"] == 3


async def test_suspending_meanwhile_drops_the_count() -> None:
    """Suspended before the old groups are gone: created again at 0, and the count is cleared
    (left behind, it would size a later, unrelated creation under autoscaling)."""
    cluster = AutoscaledLeaderWorkerSets()
    body = await autoscaled_at_three_then_four_nodes(cluster)
    await reconcile(cluster, "ns", "llama", HeaderCache())
    body["spec"]["suspend"] = True
    body["metadata"]["generation"] = 3
    cluster.collect_garbage()
    await reconcile(cluster, "ns", "llama", HeaderCache())
    assert cluster.objects[LWS]["spec"]["replicas"] == 0
    assert body["status"].get(RECREATING_REPLICAS) is None
