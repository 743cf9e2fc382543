"""Groups of pods as replicas, pure: what the cluster reports about a LeaderWorkerSet or the
StatefulSet groups, summarized as replicas (one group, one replica), and what the reconciler must
do to the StatefulSet groups that no controller does for it:

- recreate a group when one of its pods restarted or failed: the other ranks lost it too (the
  LeaderWorkerSet controller does this itself, restartPolicy RecreateGroupOnPodRestart);
- roll a group to a new template by replacing all its pods at once (updateStrategy OnDelete),
  never more groups at a time than rollout.maxUnavailable (at least one) while others are down;
- know which children a change of topology left behind (a Deployment after the replica grew
  past a node, StatefulSets beyond the group count after a scale-down);
- know when a LeaderWorkerSet must be created again to change its group size: releases before
  0.7 refuse any change of spec.leaderWorkerTemplate.size (their webhook: "field is
  immutable"); later ones roll the groups to the new size themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet_operator.models import InferenceDeploymentSpec
from kvfleet_operator.render_group import GROUP_LABEL, POD_INDEX_LABEL
from kvfleet_operator.workload_state import WorkloadState, engine_weights, pod_troubles

Manifest = dict[str, Any]
REVISION_LABEL = "controller-revision-hash"  # the StatefulSet revision a pod was created from


@dataclass(frozen=True)
class Group:
    """One StatefulSet group: the StatefulSet and its pods that are not terminating."""

    index: int
    statefulset: Manifest
    pods: tuple[Manifest, ...]
    terminating: int  # pods already being deleted

    @property
    def leader(self) -> Manifest | None:
        return next((p for p in self.pods if _labels(p).get(POD_INDEX_LABEL) == "0"), None)

    @property
    def ready(self) -> bool:
        """The leader is ready: the engine's leader reports ready only once every rank is."""
        return (
            self.terminating == 0
            and len(self.pods) == self.size
            and self.leader is not None
            and _pod_ready(self.leader)
        )

    @property
    def size(self) -> int:
        return int(self.statefulset.get("spec", {}).get("replicas", 1))

    @property
    def updated(self) -> bool:
        """Every pod runs the StatefulSet's current template."""
        revision = self.statefulset.get("status", {}).get("updateRevision")
        return (
            revision is not None
            and len(self.pods) == self.size
            and all(_labels(p).get(REVISION_LABEL) == revision for p in self.pods)
        )

    @property
    def outdated(self) -> bool:
        """A pod runs an older template (missing pods are the StatefulSet's to create)."""
        revision = self.statefulset.get("status", {}).get("updateRevision")
        return any(_labels(p).get(REVISION_LABEL) != revision for p in self.pods)

    @property
    def observed(self) -> bool:
        """The StatefulSet controller has seen the latest template (updateRevision is its)."""
        status = self.statefulset.get("status", {})
        generation = self.statefulset["metadata"].get("generation", 0)
        return "updateRevision" in status and status.get("observedGeneration", 0) >= generation

    @property
    def broken(self) -> bool:
        """A pod of the group restarted or failed: its ranks lost the group."""
        return any(_restarted_or_failed(p) for p in self.pods)


def statefulset_groups(statefulsets: list[Manifest], pods: list[Manifest]) -> list[Group]:
    """The groups, by index, each with the pods carrying its group label."""
    groups = []
    for sts in statefulsets:
        index = _labels(sts).get(GROUP_LABEL)
        if index is None or not index.isdigit():
            continue
        members = [p for p in pods if _labels(p).get(GROUP_LABEL) == index]
        live = tuple(p for p in members if not p["metadata"].get("deletionTimestamp"))
        groups.append(Group(int(index), sts, live, terminating=len(members) - len(live)))
    return sorted(groups, key=lambda g: g.index)


def summarize_statefulset_groups(
    groups: list[Group], desired: int, pods: list[Manifest]
) -> WorkloadState:
    failing, unschedulable = pod_troubles(pods)
    template = groups[0].statefulset.get("spec", {}).get("template", {}) if groups else {}
    return WorkloadState(
        desired=desired,
        replicas=len(groups),
        updated=sum(1 for g in groups if g.updated),
        ready=sum(1 for g in groups if g.ready),
        current=all(
            g.statefulset.get("status", {}).get("observedGeneration", 0)
            >= g.statefulset["metadata"].get("generation", 0)
            for g in groups
        ),
        deadline_exceeded=False,
        failing_pods=failing,
        unschedulable=unschedulable,
        quantization=engine_weights(template),
    )


def summarize_leader_worker_set(lws: Manifest, pods: list[Manifest]) -> WorkloadState:
    """From the LeaderWorkerSet controller's counts, which are groups already."""
    spec, status = lws.get("spec", {}), lws.get("status", {})
    failing, unschedulable = pod_troubles(pods)
    template = spec.get("leaderWorkerTemplate", {}).get("workerTemplate", {})
    return WorkloadState(
        desired=int(spec.get("replicas", 1)),
        replicas=int(status.get("replicas", 0)),
        updated=int(status.get("updatedReplicas", 0)),
        ready=int(status.get("readyReplicas", 0)),
        current=bool(status),  # it reports no observedGeneration; any status is its own
        deadline_exceeded=False,
        failing_pods=failing,
        unschedulable=unschedulable,
        quantization=engine_weights(template),
    )


def pods_to_replace(groups: list[Group], max_unavailable: int) -> list[str]:
    """Names of the pods to delete now (their StatefulSets create them again): every pod of a
    broken group, and of outdated groups as long as no more than max(1, maxUnavailable) groups
    are down (an outdated group that is down anyway goes first and costs nothing)."""
    doomed: list[Group] = [g for g in groups if g.terminating == 0 and g.broken]
    down = sum(1 for g in groups if not g.ready or g in doomed)
    outdated = [
        g for g in groups if g.terminating == 0 and g.observed and g.outdated and g not in doomed
    ]
    budget = max(1, max_unavailable)
    for group in sorted(outdated, key=lambda g: (g.ready, g.index)):
        if not group.ready:
            doomed.append(group)
        elif down < budget:
            doomed.append(group)
            down += 1
    return sorted(p["metadata"]["name"] for g in doomed for p in g.pods)


def group_count(
    spec: InferenceDeploymentSpec, old_status: dict[str, Any], existing: int
) -> int | None:
    """How many StatefulSet groups to render when the autoscaler owns the count: its last
    desiredReplicas (status.autoscaling), else the groups that exist, else minReplicas; within
    [minReplicas, maxReplicas]. None when the spec sets the count itself."""
    if spec.effective_replicas() is not None or spec.autoscaling is None:
        return None
    autoscaling = spec.autoscaling
    desired = (old_status.get("autoscaling") or {}).get("desiredReplicas")
    count = int(desired) if isinstance(desired, int) else existing or autoscaling.min_replicas
    return min(max(count, autoscaling.min_replicas), autoscaling.max_replicas)


def stale_children(
    rendered: list[Manifest], found: list[Manifest], owner_uid: str
) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the workloads found that this owner controls and that the
    rendered children no longer include."""
    keep = {(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in rendered}
    stale = []
    for obj in found:
        key = (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
        owners = obj["metadata"].get("ownerReferences", [])
        ours = any(o.get("uid") == owner_uid and o.get("controller") for o in owners)
        if ours and key not in keep:
            stale.append(key)
    return sorted(stale)


def _labels(obj: Manifest) -> dict[str, str]:
    labels: dict[str, str] = obj.get("metadata", {}).get("labels") or {}
    return labels


def _pod_ready(pod: Manifest) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _restarted_or_failed(pod: Manifest) -> bool:
    status = pod.get("status", {})
    if status.get("phase") == "Failed":
        return True
    return any(int(c.get("restartCount", 0)) > 0 for c in status.get("containerStatuses", []))


# The field LeaderWorkerSet releases before 0.7 refuse to change, as their webhook names it,
# and why (apimachinery's ValidateImmutableField).
LWS_SIZE_FIELD = "leaderWorkerTemplate.size"
IMMUTABLE = "field is immutable"


def group_size(lws: Manifest) -> int:
    """Pods per group of a LeaderWorkerSet (its default: 1)."""
    return int(lws.get("spec", {}).get("leaderWorkerTemplate", {}).get("size", 1))


def recreate_message(found: Manifest, rendered: Manifest, error: str) -> str:
    """The event that tells why a LeaderWorkerSet is deleted and created again."""
    return (
        f"LeaderWorkerSet {found['metadata']['name']}: the group size cannot change in place "
        f"({group_size(found)} -> {group_size(rendered)} pods per replica; {error}): deleting "
        "it with its groups, then creating it again with the new size; no replica serves "
        "meanwhile"
    )


def size_change_refused(found: Manifest | None, rendered: Manifest, error: str) -> bool:
    """Whether the API server's refusal `error` of the `rendered` LeaderWorkerSet is the one of a
    group size that cannot change in place: the one `found` has another size and the error
    names the size field as immutable. Any other refusal stays a refusal (ApplyRejected), one
    that names the size too (a policy capping it): deleting the running groups would not make
    a spec the cluster refuses pass."""
    return (
        found is not None
        and rendered["kind"] == "LeaderWorkerSet"
        and group_size(found) != group_size(rendered)
        and LWS_SIZE_FIELD in error
        and IMMUTABLE in error
    )
