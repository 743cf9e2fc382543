"""Rendering of tensor/pipeline-parallel replicas: one pod of several GPUs, a LeaderWorkerSet, or
one StatefulSet per replica (golden YAML; regenerate with UPDATE_GOLDEN=1)."""

from __future__ import annotations

import pytest

from kvfleet_operator.accelerators import resolve_accelerator
from kvfleet_operator.model_catalog import model_architecture
from kvfleet_operator.plan import ClusterFeatures, plan_deployment
from kvfleet_operator.render import render_children

# Pipeline stages are planned and rendered before the engine serves them (conftest).

NATIVE = ClusterFeatures(leader_worker_set=False, service_monitor=True)
LWS = ClusterFeatures(leader_worker_set=True, service_monitor=True)
LLAMA_405B = {"uri": "hf://meta-llama/Llama-3.1-405B-Instruct", "maxModelLen": 8192}
TWO_NODES = {"tensor": 8, "pipeline": 2}


def children(spec, cluster=NATIVE, groups=None):
    """The engines' children (the router's are test_routing's)."""
    profile = resolve_accelerator(spec.resources.accelerator, {})
    p = plan_deployment("llama", spec, profile, model_architecture(spec.model), cluster)
    assert p.ok, p.problems
    objects = render_children(
        "llama", "team-a", spec, p, profile, service_monitor=cluster.service_monitor,
        groups=groups,
    )  # fmt: skip
    return [o for o in objects if o["metadata"]["name"] != "llama-router"]


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for obj in objects:
        found.setdefault(obj["kind"], []).append(obj)
    return found


def engine(pod_spec: dict) -> dict:
    return pod_spec["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_tensor_parallel_replica_on_one_node_is_one_pod(check_golden, make_spec) -> None:
    spec = make_spec(
        model={"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
        parallelism={"tensor": 4, "pipeline": 2},
    )
    objects = children(spec)
    assert [o["kind"] for o in objects] == [
        "Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor", "NetworkPolicy"
    ]  # fmt: skip
    check_golden("parallel-one-pod", objects[:1])
    pod = objects[0]["spec"]["template"]["spec"]
    args = engine(pod)["args"]
    assert (flag(args, "--tensor-parallel-size"), flag(args, "--pipeline-parallel-size")) == (
        "4", "2"
    )  # fmt: skip
    assert "--nnodes" not in args
    assert group_key_env(engine(pod)) is None  # its ranks are processes of one pod
    assert engine(pod)["resources"]["limits"] == {"nvidia.com/gpu": 8}
    # /dev/shm: 2 GiB per GPU of the pod when resources.sharedMemory is smaller.
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "16Gi"
    assert objects[1]["spec"]["selector"] == {"kvfleet.io/deployment": "llama"}


def test_shared_memory_kept_when_large_enough(make_spec) -> None:
    spec = make_spec(parallelism={"tensor": 2}, resources={"sharedMemory": "32Gi"})
    pod = children(spec)[0]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "32Gi"
    spec = make_spec(parallelism={"tensor": 2}, resources={"sharedMemory": "1Gi"})
    pod = children(spec)[0]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "4Gi"


# Every rank answers the leader's challenge with the deployment's own key (the Secret the
# reconciler creates); optional, so ranks still start where the operator could not create it.
GROUP_KEY_REF = {"secretKeyRef": {"name": "llama-group-key", "key": "authkey", "optional": True}}


def group_key_env(container: dict) -> dict | None:
    found = [e for e in container["env"] if e["name"] == "KVFLEET_PARALLEL_AUTHKEY"]
    return found[0]["valueFrom"] if found else None


def test_native_group_is_one_statefulset_per_replica(check_golden, make_spec) -> None:
    spec = make_spec(model=LLAMA_405B, parallelism=TWO_NODES, replicas=2)
    objects = children(spec)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Service", "llama-group"),
        ("StatefulSet", "llama-group-0"),
        ("StatefulSet", "llama-group-1"),
        ("Service", "llama"),
        ("PodDisruptionBudget", "llama"),
        ("ServiceMonitor", "llama"),
        ("NetworkPolicy", "llama"),
    ]
    check_golden("group-statefulset", objects)
    headless, first, second, service, pdb = objects[:5]
    # Every rank resolves before it is ready: the leader is ready only once all ranks joined.
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    for index, sts in enumerate((first, second)):
        assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "llama-group"
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
        pod = sts["spec"]["template"]["spec"]
        container = engine(pod)
        args = container["args"]
        assert flag(args, "--tensor-parallel-size") == "8"
        assert flag(args, "--pipeline-parallel-size") == "2"
        assert flag(args, "--nnodes") == "2"
        assert flag(args, "--node-rank") == "$(KVFLEET_NODE_RANK)"
        assert flag(args, "--master-addr") == f"llama-group-{index}-0.llama-group.team-a.svc"
        assert flag(args, "--master-port") == "29500"
        rank_env = next(e for e in container["env"] if e["name"] == "KVFLEET_NODE_RANK")
        assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.labels['apps.kubernetes.io/pod-index']"
        )
        assert group_key_env(container) == GROUP_KEY_REF
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
        # The ranks of one group keep off each other's nodes; other groups may share them.
        term = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term == [
            {
                "labelSelector": {
                    "matchLabels": {
                        "kvfleet.io/deployment": "llama",
                        "kvfleet.io/group": str(index),
                    }
                },
                "topologyKey": "kubernetes.io/hostname",
            }
        ]
        assert sts["spec"]["selector"]["matchLabels"]["kvfleet.io/group"] == str(index)
    # The API Service sends requests to leaders only; workers answer 404 on every API path.
    assert service["spec"]["selector"] == {
        "kvfleet.io/deployment": "llama", "apps.kubernetes.io/pod-index": "0"
    }  # fmt: skip
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"kvfleet.io/deployment": "llama"}},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }


def test_autoscaled_native_groups_follow_the_autoscalers_count(make_spec) -> None:
    autoscaling = {"minReplicas": 1, "maxReplicas": 4, "targets": {"kvCacheUtilization": 0.7}}
    spec = make_spec(
        model=LLAMA_405B, parallelism=TWO_NODES, replicas=None, autoscaling=autoscaling
    )
    names = [o["metadata"]["name"] for o in by_kind(children(spec, groups=3))["StatefulSet"]]
    assert names == ["llama-group-0", "llama-group-1", "llama-group-2"]
    suspended = make_spec(model=LLAMA_405B, parallelism=TWO_NODES, suspend=True)
    assert "StatefulSet" not in by_kind(children(suspended))


def test_leader_worker_set_when_the_cluster_serves_it(check_golden, make_spec) -> None:
    spec = make_spec(
        model=LLAMA_405B,
        parallelism=TWO_NODES,
        rollout={"maxSurge": 1, "maxUnavailable": 0},
    )
    objects = children(spec, LWS)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("LeaderWorkerSet", "llama-group"),
        ("Service", "llama"),
        ("PodDisruptionBudget", "llama"),
        ("ServiceMonitor", "llama"),
        ("NetworkPolicy", "llama"),
    ]
    check_golden("group-leaderworkerset", objects)
    lws = objects[0]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["replicas"] == 2
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxUnavailable": 0, "maxSurge": 1
    }  # fmt: skip
    template = lws["spec"]["leaderWorkerTemplate"]
    assert (template["size"], template["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    args = engine(template["workerTemplate"]["spec"])["args"]
    assert group_key_env(engine(template["workerTemplate"]["spec"])) == GROUP_KEY_REF
    assert flag(args, "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
    affinity = template["workerTemplate"]["spec"]["affinity"]["podAntiAffinity"]
    term = affinity["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
    assert objects[1]["spec"]["selector"] == {
        "kvfleet.io/deployment": "llama", "leaderworkerset.sigs.k8s.io/worker-index": "0"
    }  # fmt: skip


@pytest.mark.parametrize("controller", ["HPA", "Builtin"])
def test_autoscaled_leader_worker_set_leaves_replicas_to_the_autoscaler(
    make_spec, controller
) -> None:
    autoscaling = {
        "controller": controller, "minReplicas": 1, "maxReplicas": 4,
        "targets": {"kvCacheUtilization": 0.7},
    }  # fmt: skip
    spec = make_spec(
        model=LLAMA_405B, parallelism=TWO_NODES, replicas=None, autoscaling=autoscaling
    )
    found = by_kind(children(spec, LWS))
    assert "replicas" not in found["LeaderWorkerSet"][0]["spec"]
    if controller == "HPA":
        assert found["HorizontalPodAutoscaler"][0]["spec"]["scaleTargetRef"] == {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "name": "llama-group",
        }
