"""Groups as replicas, without a cluster: readiness by the leader, recreation of a broken group,
rollout one group at a time, the autoscaler's group count, and pruning."""

from __future__ import annotations

from typing import Any

from kvfleet_operator.topology_groups import (
    group_count,
    pods_to_replace,
    stale_children,
    statefulset_groups,
    summarize_leader_worker_set,
    summarize_statefulset_groups,
)


def sts(index: int, *, size: int = 2, revision: str = "r2", generation: int = 1) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": f"llama-group-{index}",
            "generation": generation,
            "labels": {"kvfleet.io/deployment": "llama", "kvfleet.io/group": str(index)},
        },
        "spec": {"replicas": size, "template": {"spec": {"containers": [
            {"name": "engine", "args": ["--quantization", "fp8"]}]}}},
        "status": {"observedGeneration": generation, "updateRevision": revision},
    }  # fmt: skip


def pod(
    group: int,
    rank: int,
    *,
    ready: bool = True,
    revision: str = "r2",
    restarts: int = 0,
    deleting: bool = False,
) -> dict:
    meta: dict[str, Any] = {
        "name": f"llama-group-{group}-{rank}",
        "labels": {
            "kvfleet.io/deployment": "llama",
            "kvfleet.io/group": str(group),
            "apps.kubernetes.io/pod-index": str(rank),
            "controller-revision-hash": revision,
        },
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {
        "metadata": meta,
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "engine", "restartCount": restarts}],
        },
    }


def test_a_group_is_ready_when_its_leader_is_and_all_ranks_exist() -> None:
    pods = [pod(0, 0), pod(0, 1), pod(1, 0, ready=False), pod(1, 1), pod(2, 0)]
    groups = statefulset_groups([sts(0), sts(1), sts(2)], pods)
    assert [(g.index, g.ready) for g in groups] == [(0, True), (1, False), (2, False)]
    state = summarize_statefulset_groups(groups, 3, pods)
    assert (state.desired, state.replicas, state.ready, state.updated) == (3, 3, 1, 2)
    assert state.current and state.quantization == "fp8"
    # A worker that is not ready does not make the group unready: the leader speaks for all.
    groups = statefulset_groups([sts(0)], [pod(0, 0), pod(0, 1, ready=False)])
    assert groups[0].ready


def test_a_restarted_rank_recreates_its_whole_group() -> None:
    pods = [pod(0, 0), pod(0, 1, restarts=1), pod(1, 0), pod(1, 1)]
    assert pods_to_replace(statefulset_groups([sts(0), sts(1)], pods), 1) == [
        "llama-group-0-0", "llama-group-0-1"
    ]  # fmt: skip
    # Once its pods are terminating, nothing more is deleted.
    pods = [pod(0, 0, deleting=True), pod(0, 1, restarts=1, deleting=True), pod(1, 0), pod(1, 1)]
    assert pods_to_replace(statefulset_groups([sts(0), sts(1)], pods), 1) == []


def test_outdated_groups_roll_one_at_a_time() -> None:
    old = [pod(g, r, revision="r1") for g in range(3) for r in range(2)]
    groups = statefulset_groups([sts(0), sts(1), sts(2)], old)
    assert pods_to_replace(groups, 1) == ["llama-group-0-0", "llama-group-0-1"]
    assert len(pods_to_replace(groups, 2)) == 4
    # Group 0 is being replaced (down): no other ready group goes meanwhile.
    rolling = [pod(0, 0, revision="r2", ready=False), *old[2:]]
    assert pods_to_replace(statefulset_groups([sts(0), sts(1), sts(2)], rolling), 1) == []
    # An outdated group that is down anyway is replaced at once, whatever the budget.
    down = [pod(0, 0), pod(0, 1), pod(1, 0, revision="r1", ready=False),
            pod(1, 1, revision="r1"), pod(2, 0), pod(2, 1)]  # fmt: skip
    assert pods_to_replace(statefulset_groups([sts(0), sts(1), sts(2)], down), 0) == [
        "llama-group-1-0", "llama-group-1-1"
    ]  # fmt: skip
    # Until the StatefulSet controller saw the new template, nothing is judged outdated.
    unseen = sts(0, generation=2)
    unseen["status"]["observedGeneration"] = 1
    assert pods_to_replace(statefulset_groups([unseen], old[:2]), 1) == []


def test_group_count_for_the_autoscaler(make_spec) -> None:
    autoscaling = {"minReplicas": 1, "maxReplicas": 4, "targets": {"kvCacheUtilization": 0.7}}
    spec = make_spec(replicas=None, autoscaling=autoscaling)
    assert group_count(spec, {}, 0) == 1
    assert group_count(spec, {}, 3) == 3
    assert group_count(spec, {"autoscaling": {"desiredReplicas": 2}}, 3) == 2
    assert group_count(spec, {"autoscaling": {"desiredReplicas": 9}}, 3) == 4
    assert group_count(make_spec(replicas=2), {"autoscaling": {"desiredReplicas": 3}}, 1) is None


def test_stale_children_are_only_ours_and_unrendered() -> None:
    ours = [{"uid": "u-1", "controller": True}]
    found = [
        {**sts(0), "metadata": {**sts(0)["metadata"], "ownerReferences": ours}},
        {**sts(1), "metadata": {**sts(1)["metadata"], "ownerReferences": ours}},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": "llama", "ownerReferences": ours}},
        {"apiVersion": "v1", "kind": "Service",  # the LeaderWorkerSet's own headless Service
         "metadata": {"name": "llama-group",
                      "ownerReferences": [{"uid": "lws", "controller": True}]}},
    ]  # fmt: skip
    assert stale_children([sts(0)], found, "u-1") == [
        ("apps/v1", "Deployment", "llama"), ("apps/v1", "StatefulSet", "llama-group-1")
    ]  # fmt: skip


def test_leader_worker_set_counts_are_groups() -> None:
    lws = {
        "metadata": {"name": "llama-group"},
        "spec": {"replicas": 3, "leaderWorkerTemplate": {"workerTemplate": {"spec": {}}}},
        "status": {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 1},
    }
    state = summarize_leader_worker_set(lws, [])
    assert (state.desired, state.replicas, state.ready, state.updated) == (3, 3, 2, 1)
    assert state.quantization == "none"
    assert not summarize_leader_worker_set({**lws, "status": {}}, []).current
