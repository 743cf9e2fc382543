"""Install manifests, samples and the Argo CD health check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa
import pytest
import yaml

from kvfleet_operator.accelerators import resolve_accelerator
from kvfleet_operator.model_catalog import model_architecture
from kvfleet_operator.models import AcceleratorProfileSpec, InferenceDeploymentSpec
from kvfleet_operator.plan import ClusterFeatures, plan_deployment

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


def _plan(path: str, gguf_header=None):
    sample = yaml.safe_load((MANIFESTS / "samples" / path).read_text())
    spec = InferenceDeploymentSpec.model_validate(sample["spec"])
    custom = yaml.safe_load((MANIFESTS / "samples" / "accelerator-profile.yaml").read_text())
    profiles = {custom["metadata"]["name"]: AcceleratorProfileSpec.model_validate(custom["spec"])}
    profile = resolve_accelerator(spec.resources.accelerator, profiles)
    cluster = ClusterFeatures(leader_worker_set=False, service_monitor=False)
    architecture = model_architecture(spec.model, gguf_header)
    return plan_deployment(sample["metadata"]["name"], spec, profile, architecture, cluster)


def test_small_sample_plans_cleanly() -> None:
    p = _plan("small.yaml")
    assert p.ok and p.memory is not None and p.memory.fits


def test_large_sample_is_one_pod_of_four_gpus() -> None:
    p = _plan("large.yaml")
    assert p.ok, p.problems
    assert p.memory is not None and p.memory.fits
    assert p.topology is not None and p.topology.kind == "Deployment"
    assert (p.topology.gpus_per_pod, p.topology.pods_per_replica) == (4, 1)


def test_multi_node_sample_is_a_group_of_two_pods() -> None:
    p = _plan("multi-node.yaml")
    assert p.ok, p.problems
    assert p.memory is not None and p.memory.fits
    assert p.topology is not None and p.topology.kind == "StatefulSet"
    assert (p.topology.nodes_per_replica, p.topology.gpus_per_pod) == (2, 4)


def test_quantized_sample_plans_awq_weights_and_an_fp8_kv_cache_on_an_l4() -> None:
    p = _plan("quantized.yaml")
    assert p.ok and p.memory is not None and p.memory.source == "hints"
    assert (p.memory.weights_gib, p.memory.kv_cache_gib, p.memory.required_gib) == (
        5.41, 8.12, 15.04
    )  # fmt: skip
    assert p.memory.available_gib == 21.6 and p.memory.fits
    # The same spec on an A100 (compute capability 8.0) stops at the fp8 KV cache.
    sample = yaml.safe_load((MANIFESTS / "samples" / "quantized.yaml").read_text())
    sample["spec"]["resources"]["accelerator"] = "a100-80gb"
    spec = InferenceDeploymentSpec.model_validate(sample["spec"])
    profile = resolve_accelerator("a100-80gb", {})
    cluster = ClusterFeatures(leader_worker_set=False, service_monitor=False)
    a100 = plan_deployment("x", spec, profile, model_architecture(spec.model), cluster)
    assert [problem.reason for problem in a100.problems] == ["UnsupportedQuantization"]
    assert a100.problems[0].message.startswith("quantization.kvCache=fp8 needs compute capability")


def test_gguf_sample_plans_from_the_files_header(write_gguf) -> None:
    from kvfleet_operator.gguf_header import parse_gguf_header

    path = write_gguf(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, context=131072,
        with_data=False,
    )  # fmt: skip
    p = _plan("gguf.yaml", parse_gguf_header(path.read_bytes()))
    assert p.ok and p.memory is not None and p.memory.source == "ggufHeader" and p.memory.fits
    assert _plan("gguf.yaml").memory is None  # without the header: not estimated


def test_kustomization_lists_existing_files() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (MANIFESTS / resource).exists(), resource


# What a change of a replica's shape deletes (topology_workloads.py): group pods, StatefulSets,
# and the workload a change of topology leaves behind; and the optional children a spec change
# stops rendering (prune_optional: the router's objects, NetworkPolicy, HPA, ScaledObject,
# ServiceMonitor).
DELETABLE = {"pods", "statefulsets", "deployments", "services", "leaderworkersets",
             "poddisruptionbudgets", "serviceaccounts", "roles", "rolebindings",
             "networkpolicies", "horizontalpodautoscalers", "scaledobjects",
             "servicemonitors"}  # fmt: skip


def test_rbac_never_writes_inference_deployment_spec_and_deletes_only_its_children() -> None:
    role = next(yaml.safe_load_all((MANIFESTS / "rbac.yaml").read_text()))
    deletable = set()
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        if "delete" in rule["verbs"]:
            deletable |= set(rule["resources"])
        if "inferencedeployments" in rule["resources"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}
    assert deletable == DELETABLE


def test_rbac_may_delete_every_optional_child() -> None:
    """Turning routing, the NetworkPolicy or an HPA/KEDA controller off deletes those children
    (prune_optional). Without delete in the shipped role every reconcile of the changed spec
    failed with 403 and its status stayed at the old generation."""
    from kvfleet_operator.apply import RESOURCES
    from kvfleet_operator.topology_workloads import optional_children

    role = next(yaml.safe_load_all((MANIFESTS / "rbac.yaml").read_text()))
    deletable = {
        (group, resource)
        for rule in role["rules"]
        if "delete" in rule["verbs"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    for api_version, kind, _ in optional_children("x"):
        plural, _ = RESOURCES[(api_version, kind)]
        assert (api_version.rpartition("/")[0], plural) in deletable, kind


def test_rbac_covers_every_kind_the_operator_renders(make_spec) -> None:
    """Each kind rendered for any topology can be applied (create, patch) by the role."""
    from kvfleet_operator.render import render_children

    role = next(yaml.safe_load_all((MANIFESTS / "rbac.yaml").read_text()))
    granted = {
        (group, resource)
        for rule in role["rules"]
        if {"create", "patch"} <= set(rule["verbs"])
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    from kvfleet_operator.apply import RESOURCES

    for parallelism, lws in (({"tensor": 2}, False), ({"tensor": 8, "pipeline": 2}, False),
                             ({"tensor": 8, "pipeline": 2}, True)):  # fmt: skip
        spec = make_spec(parallelism=parallelism)
        profile = resolve_accelerator(spec.resources.accelerator, {})
        cluster = ClusterFeatures(leader_worker_set=lws, service_monitor=True)
        p = plan_deployment("x", spec, profile, model_architecture(spec.model), cluster)
        for child in render_children("x", "ns", spec, p, profile, service_monitor=True):
            group = child["apiVersion"].rpartition("/")[0]
            plural, _ = RESOURCES[(child["apiVersion"], child["kind"])]
            assert (group, plural) in granted, child["kind"]


def health(obj: dict[str, Any]) -> tuple[str, str]:
    runtime = lupa.LuaRuntime(unpack_returned_tuples=True)
    runtime.globals().obj = _to_lua(runtime, obj)
    result = runtime.execute((MANIFESTS / "argocd" / "health.lua").read_text())
    return result["status"], result["message"]


def _to_lua(runtime: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return runtime.table_from({k: _to_lua(runtime, v) for k, v in value.items()})
    if isinstance(value, list):
        return runtime.table_from([_to_lua(runtime, v) for v in value])
    return value


def _obj(conditions: list[tuple[str, str, str]], observed: int = 2, suspend: bool = False):
    return {
        "metadata": {"generation": 2},
        "spec": {"suspend": suspend},
        "status": {
            "observedGeneration": observed,
            "conditions": [
                {"type": t, "status": s, "reason": r, "message": f"{t} {r}"}
                for t, s, r in conditions
            ],
        },
    }


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"metadata": {"generation": 1}, "spec": {}}, "Progressing"),
        (_obj([("Ready", "True", "AllReplicasReady")], observed=1), "Progressing"),
        (_obj([("Ready", "True", "AllReplicasReady"), ("Stalled", "False", "Healthy")]), "Healthy"),
        (_obj([("Ready", "False", "RollingOut"), ("Reconciling", "True", "RollingOut")]),
         "Progressing"),
        (_obj([("Ready", "False", "X"), ("Stalled", "True", "InsufficientGPUMemory")]),
         "Degraded"),
        (_obj([("Ready", "True", "Suspended")], suspend=True), "Suspended"),
    ],
)  # fmt: skip
def test_argocd_health(obj: dict[str, Any], expected: str) -> None:
    status, message = health(obj)
    assert status == expected
    if expected == "Degraded":
        assert message.startswith("InsufficientGPUMemory: ")


def test_accelerator_profile_sample_parses() -> None:
    from kvfleet_operator.models import AcceleratorProfileSpec

    sample = yaml.safe_load((MANIFESTS / "samples" / "accelerator-profile.yaml").read_text())
    profile = AcceleratorProfileSpec.model_validate(sample["spec"])
    assert profile.memory_gib == 48 and profile.devices_per_node == 4
