"""An InferenceDeployment's workload as the cluster has it, read and acted on through the apply
layer: its Deployment, LeaderWorkerSet or StatefulSet groups (and their headless Service), and
their pods. The decisions are topology_groups' (pure); this module only fetches and deletes."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from kvfleet_operator import api
from kvfleet_operator.apply import Cluster, foreign_controller
from kvfleet_operator.autoscaling.actuators import EXTERNAL_KINDS
from kvfleet_operator.render import selector_string
from kvfleet_operator.render_router import router_name
from kvfleet_operator.topology import group_name
from kvfleet_operator.topology_groups import (
    pods_to_replace,
    stale_children,
    statefulset_groups,
    summarize_leader_worker_set,
    summarize_statefulset_groups,
)
from kvfleet_operator.workload_state import (
    WorkloadState,
    deployment_failure,
    external_scaling,
    summarize_workload,
)

log = logging.getLogger(__name__)
Manifest = dict[str, Any]


@dataclass
class Workloads:
    """What exists of one InferenceDeployment's workload."""

    deployment: Manifest | None = None
    leader_worker_set: Manifest | None = None
    statefulsets: list[Manifest] = field(default_factory=list)
    rank_service: Manifest | None = None  # the StatefulSet groups' headless Service
    pods: list[Manifest] = field(default_factory=list)
    router: Manifest | None = None  # the router's Deployment (routing.enabled), for its health
    autoscaler: Manifest | None = None  # the HPA or ScaledObject (controller HPA / KEDA)

    def objects(self) -> list[Manifest]:
        """Every workload object found (the candidates for pruning)."""
        found = [self.deployment, self.leader_worker_set, *self.statefulsets, self.rank_service]
        return [obj for obj in found if obj is not None]

    def main(self, kind: str) -> Manifest | None:
        """The object whose creation or generation tells a rollout: the Deployment, the
        LeaderWorkerSet, or the first StatefulSet."""
        if kind == "Deployment":
            return self.deployment
        if kind == "LeaderWorkerSet":
            return self.leader_worker_set
        return self.statefulsets[0] if self.statefulsets else None

    def kind(self, planned: str | None) -> str | None:
        """The kind to report: the planned one when it exists, else whichever does."""
        present = {
            "Deployment": self.deployment is not None,
            "LeaderWorkerSet": self.leader_worker_set is not None,
            "StatefulSet": bool(self.statefulsets),
        }
        if planned is not None and present.get(planned):
            return planned
        return next((kind for kind, here in present.items() if here), None)

    def summary(self, planned: str | None, desired_groups: int | None) -> WorkloadState | None:
        state = self._engines(planned, desired_groups)
        if state is None:
            return None
        if self.router is not None:
            state = dataclasses.replace(state, router_failure=deployment_failure(self.router))
        if self.autoscaler is not None:
            state = dataclasses.replace(state, external_scaling=external_scaling(self.autoscaler))
        return state

    def _engines(self, planned: str | None, desired_groups: int | None) -> WorkloadState | None:
        kind = self.kind(planned)
        if kind == "Deployment":
            assert self.deployment is not None
            return summarize_workload(self.deployment, self.pods)
        if kind == "LeaderWorkerSet":
            assert self.leader_worker_set is not None
            return summarize_leader_worker_set(self.leader_worker_set, self.pods)
        if kind == "StatefulSet":
            groups = statefulset_groups(self.statefulsets, self.pods)
            desired = len(groups) if desired_groups is None else desired_groups
            return summarize_statefulset_groups(groups, desired, self.pods)
        return None


async def read_workloads(
    cluster: Cluster,
    owner: Manifest,
    *,
    leader_worker_set: bool,
    router: bool,
    autoscaler: tuple[str, str] | None = None,
) -> Workloads:
    """The workload objects and pods of the InferenceDeployment `owner`; the LeaderWorkerSet
    only where it is served, the router's Deployment only where routing is enabled, the external
    autoscaler ((apiVersion, kind) of the HPA or ScaledObject) where the spec has one. An object
    of a child's name that another owner controls is not its (`foreign_controller`): absent."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    selector = selector_string(name)

    async def get(api_version: str, kind: str, child: str) -> Manifest | None:
        obj = await cluster.get(api_version, kind, child, namespace)
        return obj if obj is None or foreign_controller(obj, owner) is None else None

    found = Workloads(
        deployment=await get("apps/v1", "Deployment", name),
        statefulsets=[
            sts
            for sts in await cluster.list("apps/v1", "StatefulSet", namespace, selector)
            if foreign_controller(sts, owner) is None
        ],
        rank_service=await get("v1", "Service", group_name(name)),
        pods=await cluster.list("v1", "Pod", namespace, selector),
    )
    if router:
        found.router = await get("apps/v1", "Deployment", router_name(name))
    if autoscaler is not None:
        found.autoscaler = await get(*autoscaler, name)
    if leader_worker_set:
        found.leader_worker_set = await get(
            api.LEADER_WORKER_SET_API, "LeaderWorkerSet", group_name(name)
        )
    for sts in found.statefulsets:  # the items of a list carry no apiVersion or kind
        sts.setdefault("apiVersion", "apps/v1")
        sts.setdefault("kind", "StatefulSet")
    return found


async def prune(
    cluster: Cluster, namespace: str, rendered: list[Manifest], found: Workloads, owner_uid: str
) -> None:
    """Delete the workload objects the rendered children no longer include: StatefulSets past
    the group count, or the workload of the topology before a change of kind."""
    for api_version, kind, name in stale_children(rendered, found.objects(), owner_uid):
        log.info("%s/%s: deleting %s %s (no longer rendered)", namespace, name, kind, name)
        await cluster.delete(api_version, kind, name, namespace)


def optional_children(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every child that some specs render and others do not: the
    external autoscaler (controller HPA or KEDA), the NetworkPolicy, the ServiceMonitor and the
    router's objects. Checked against the renderers by test_every_optional_child_is_known."""
    router = router_name(name)
    return [
        *((api_version, kind, name) for api_version, kind in EXTERNAL_KINDS),
        ("networking.k8s.io/v1", "NetworkPolicy", name),
        ("monitoring.coreos.com/v1", "ServiceMonitor", name),
        ("apps/v1", "Deployment", router),
        ("v1", "Service", router),
        ("policy/v1", "PodDisruptionBudget", router),
        ("monitoring.coreos.com/v1", "ServiceMonitor", router),
        ("v1", "ServiceAccount", router),
        ("rbac.authorization.k8s.io/v1", "Role", router),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", router),
    ]


async def prune_optional(
    cluster: Cluster, namespace: str, name: str, rendered: list[Manifest], owner_uid: str
) -> None:
    """Delete the optional children (`optional_children`) this owner controls that the spec no
    longer renders: routing or the NetworkPolicy turned off, autoscaling moved off HPA or KEDA.
    One GET each, so the reconciler calls it when the spec changed, not on every pass. A kind
    whose CRD is not installed reads as absent."""
    keep = {(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in rendered}
    found = []
    for api_version, kind, child in optional_children(name):
        if (api_version, kind, child) in keep:
            continue
        obj = await cluster.get(api_version, kind, child, namespace)
        if obj is not None:
            found.append({**obj, "apiVersion": api_version, "kind": kind})
    for api_version, kind, child in stale_children(rendered, found, owner_uid):
        log.info("%s/%s: deleting %s %s (no longer rendered)", namespace, name, kind, child)
        await cluster.delete(api_version, kind, child, namespace)


async def delete_leader_worker_set(cluster: Cluster, lws: Manifest) -> None:
    """Delete a LeaderWorkerSet whose group size cannot change in place, its groups first
    (foreground: it is gone only once its StatefulSets and pods are, so the one created again
    under its name never meets pods of the old size)."""
    meta = lws["metadata"]
    log.info("%s/%s: deleting it to change its group size", meta["namespace"], meta["name"])
    await cluster.delete(
        api.LEADER_WORKER_SET_API,
        "LeaderWorkerSet",
        meta["name"],
        meta["namespace"],
        propagation="Foreground",
    )


async def replace_group_pods(
    cluster: Cluster, namespace: str, found: Workloads, max_unavailable: int
) -> list[str]:
    """Delete the pods of broken and outdated StatefulSet groups (topology_groups), so that
    their StatefulSets recreate each group whole; returns the pod names."""
    names = pods_to_replace(statefulset_groups(found.statefulsets, found.pods), max_unavailable)
    for pod in names:
        await cluster.delete("v1", "Pod", pod, namespace)
    return names
