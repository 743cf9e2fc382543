"""Rendering, pure: a replica larger than one node, as a group of pods, one per node, each one
`kvfleet serve --nnodes N --node-rank R`; rank 0 (the leader) serves the OpenAI API and answers
/ready only once every rank has joined, so a group is ready exactly when its leader is.

LeaderWorkerSet (when the cluster serves leaderworkerset.x-k8s.io/v1): one object `NAME-group`,
`replicas` groups of `size` pods. The LWS controller injects LWS_WORKER_INDEX (the node rank)
and LWS_LEADER_ADDRESS (the leader's DNS name in the headless Service it creates, named after
the LWS), and recreates a whole group when one of its pods restarts.

Native (any cluster): one StatefulSet `NAME-group-I` per replica I, all governed by one headless
Service `NAME-group` (publishNotReadyAddresses: the ranks must find the leader before it is
ready). The node rank is the pod's ordinal, read from the `apps.kubernetes.io/pod-index` label
through the downward API; the leader is `NAME-group-I-0.NAME-group.NAMESPACE.svc`. Pods start
in parallel (OrderedReady would wait for a leader that waits for its ranks) and are updated
OnDelete: the reconciler replaces a group's pods all at once (topology_groups.py), never one
rank of a running group.
"""

from __future__ import annotations

from typing import Any

from kvfleet_operator import api
from kvfleet_operator.models import AcceleratorProfileSpec, InferenceDeploymentSpec
from kvfleet_operator.plan import Plan
from kvfleet_operator.render_pod import (
    ENGINE_TYPE_LABEL,
    GROUP_KEY,
    MASTER_PORT,
    Ranks,
    pod_spec,
)
from kvfleet_operator.topology import group_key_secret, group_name, statefulset_name

Manifest = dict[str, Any]

GROUP_LABEL = f"{api.GROUP}/group"  # native: the replica (StatefulSet index) a pod belongs to
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # written by the StatefulSet controller
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
NODE_RANK_ENV = "KVFLEET_NODE_RANK"


def leader_address(name: str, namespace: str, index: int) -> str:
    """The stable DNS name of group `index`'s leader (ordinal 0) in the headless Service."""
    return f"{statefulset_name(name, index)}-0.{group_name(name)}.{namespace}.svc"


def leader_selector(kind: str) -> dict[str, str]:
    """The labels, beyond the deployment's, that only a group's leader pod carries."""
    if kind == "StatefulSet":
        return {POD_INDEX_LABEL: "0"}
    if kind == "LeaderWorkerSet":
        return {LWS_WORKER_INDEX_LABEL: "0"}
    return {}


def render_group_key(name: str, namespace: str, labels: dict[str, str], key: str) -> Manifest:
    """The Secret of the groups' step-channel key: every rank answers the leader's challenge
    with it, so only the pods of this deployment can join a group (and read its steps: the
    prompts' token ids). `key` is random, made once by the reconciler when it creates the
    Secret, never rendered again (applying it on each pass would change it under running
    groups)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": group_key_secret(name), "namespace": namespace, "labels": labels},
        "stringData": {GROUP_KEY: key},
    }


def render_leader_worker_set(
    name: str,
    namespace: str,
    labels: dict[str, str],
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
) -> Manifest:
    assert plan.topology is not None and plan.topology.kind == "LeaderWorkerSet", plan.topology
    ranks = Ranks(
        nnodes=plan.topology.pods_per_replica,
        node_rank="$(LWS_WORKER_INDEX)",
        master_addr="$(LWS_LEADER_ADDRESS)",
        key_secret=group_key_secret(name),
    )
    # Apart within a group (LWS gives each group its own group-key), side by side across groups.
    apart = _one_per_node({api.DEPLOYMENT_LABEL: name}, match_label_keys=[LWS_GROUP_KEY_LABEL])
    lws_spec: dict[str, Any] = {
        "startupPolicy": "LeaderCreated",  # LeaderReady would wait for a leader waiting for ranks
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {
                "maxUnavailable": spec.rollout.max_unavailable,
                "maxSurge": spec.rollout.max_surge,
            },
        },
        "leaderWorkerTemplate": {
            "size": plan.topology.pods_per_replica,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "workerTemplate": {
                "metadata": {"labels": {**labels, **ENGINE_TYPE_LABEL}},
                "spec": pod_spec(spec, plan, profile, ranks=ranks, affinity=apart),
            },
        },
    }
    replicas = spec.effective_replicas()
    if replicas is not None:  # left out when the autoscaler owns it
        lws_spec = {"replicas": replicas, **lws_spec}
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": group_name(name), "namespace": namespace, "labels": dict(labels)},
        "spec": lws_spec,
    }


def render_statefulsets(
    name: str,
    namespace: str,
    labels: dict[str, str],
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
    groups: int,
) -> list[Manifest]:
    """StatefulSets 0 .. groups - 1, one per replica."""
    return [
        render_statefulset(name, namespace, labels, spec, plan, profile, i) for i in range(groups)
    ]


def render_statefulset(
    name: str,
    namespace: str,
    labels: dict[str, str],
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
    index: int,
) -> Manifest:
    assert plan.topology is not None and plan.topology.kind == "StatefulSet", plan.topology
    member = {api.DEPLOYMENT_LABEL: name, GROUP_LABEL: str(index)}
    pod_index = {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}
    ranks = Ranks(
        nnodes=plan.topology.pods_per_replica,
        node_rank=f"$({NODE_RANK_ENV})",
        master_addr=leader_address(name, namespace, index),
        key_secret=group_key_secret(name),
        env=[{"name": NODE_RANK_ENV, "valueFrom": pod_index}],
    )
    pod_labels = {**labels, GROUP_LABEL: str(index)}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": statefulset_name(name, index),
            "namespace": namespace,
            "labels": dict(pod_labels),
        },
        "spec": {
            "replicas": plan.topology.pods_per_replica,
            "serviceName": group_name(name),
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": dict(member)},
            "template": {
                "metadata": {"labels": {**pod_labels, **ENGINE_TYPE_LABEL}},
                "spec": pod_spec(spec, plan, profile, ranks=ranks, affinity=_one_per_node(member)),
            },
        },
    }


def render_rank_service(name: str, namespace: str, labels: dict[str, str]) -> Manifest:
    """The headless Service that gives every rank of the StatefulSet groups a DNS name."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": group_name(name), "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {api.DEPLOYMENT_LABEL: name},
            # torch.distributed meets at the leader's MASTER_PORT, the engine's step channel at
            # the next port; gloo and NCCL then connect the ranks on ports of their own.
            "ports": [
                {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}
                for name, port in (("ranks", MASTER_PORT), ("steps", MASTER_PORT + 1))
            ],
        },
    }


def _one_per_node(
    match_labels: dict[str, str], match_label_keys: list[str] | None = None
) -> dict[str, Any]:
    term: dict[str, Any] = {
        "labelSelector": {"matchLabels": dict(match_labels)},
        "topologyKey": HOSTNAME_TOPOLOGY,
    }
    if match_label_keys:
        term["matchLabelKeys"] = match_label_keys
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
