"""One reconcile against an in-memory API: children applied with owner references, status
written once, and nothing written when nothing changed."""

from __future__ import annotations

import copy
import re
from typing import Any

import httpx

from kvfleet_operator import api
from kvfleet_operator.apply import with_owner
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.reconcile import reconcile


class MemoryCluster:
    """The subset of apply.Cluster that reconcile uses, backed by a dict."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.status_patches: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.applied: list[str] = []
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}
        self.secret_reads = 0

    def add(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.objects[(obj["kind"], meta.get("namespace", ""), meta["name"])] = obj

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None):
        return copy.deepcopy(self.objects.get((kind, namespace or "", name)))

    async def list(self, api_version: str, kind: str, namespace=None, selector: str = ""):
        return [copy.deepcopy(o) for (k, _, _), o in self.objects.items() if k == kind]

    async def has_crd(self, name: str) -> bool:
        return False

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        self.secret_reads += 1
        return self.secrets.get((namespace, name), {}).get(key)

    async def apply(self, manifest: dict[str, Any], *, owner=None, field_manager=""):
        manifest = with_owner(manifest, owner) if owner else manifest
        key = (manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        previous = self.objects.get(key)
        generation = (previous or {}).get("metadata", {}).get("generation", 0)
        if previous is None or previous.get("spec") != manifest.get("spec"):
            generation += 1
        stored = copy.deepcopy(manifest)
        stored["metadata"]["generation"] = generation
        self.objects[key] = stored
        self.applied.append(manifest["kind"])
        return copy.deepcopy(stored)

    async def patch_status(self, api_version, kind, name, namespace, status):
        self.status_patches.append(status)
        obj = self.objects[(kind, namespace, name)]
        obj["status"] = {**obj.get("status", {}), **status}
        return obj

    async def post_event(self, involved, type_, reason, message) -> None:
        self.events.append(reason)


# The engines' objects, then the router's (routing.enabled is the default).
CHILDREN = ["Deployment", "Service", "PodDisruptionBudget"]
ROUTER = ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "PodDisruptionBudget"]


def infd(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.INFERENCE_DEPLOYMENT,
        "metadata": {"name": "llama", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {
            "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
            "resources": {"accelerator": "h100-80gb"},
            **spec,
        },
    }


async def test_reconcile_applies_children_then_is_a_no_op() -> None:
    cluster = MemoryCluster()
    cluster.add(infd(replicas=2))
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.applied == CHILDREN + ROUTER
    deployment = cluster.objects[("Deployment", "ns", "llama")]
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert len(cluster.status_patches) == 1 and cluster.events == ["Created"]
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    assert status["observedGeneration"] == 1 and status["replicasSummary"] == "0/2"

    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert len(cluster.status_patches) == 1, "an unchanged object must not be written again"
    assert cluster.events == ["Created"]


async def test_stalled_spec_applies_nothing_and_explains() -> None:
    cluster = MemoryCluster()
    cluster.add(infd(quantization={"weights": "fp8"}, resources={"accelerator": "a100-80gb"}))
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.applied == []
    assert cluster.events == ["UnsupportedQuantization"]


async def test_invalid_spec_is_reported_not_raised() -> None:
    cluster = MemoryCluster()
    autoscaling = {"maxReplicas": 2, "targets": {}}  # no target: the model rejects it
    cluster.add(infd(autoscaling=autoscaling))
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    conditions = cluster.status_patches[0]["conditions"]
    stalled = next(c for c in conditions if c["type"] == "Stalled")
    assert stalled["reason"] == "InvalidSpec" and "autoscaling" in stalled["message"]


async def test_hf_gguf_is_planned_from_its_header_read_once(write_gguf) -> None:
    data = write_gguf(layers=32, hidden=4096, heads=32, kv_heads=8, with_data=False).read_bytes()
    requests: list[httpx.Request] = []

    def hub(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        start, last = map(int, re.findall(r"\d+", request.headers["range"]))
        return httpx.Response(206, content=data[start : last + 1])

    cluster = MemoryCluster()
    cluster.secrets[("ns", "hf-token")] = {"HF_TOKEN": "hf_abc"}
    uri = "hf://acme/Llama-GGUF/llama-Q4_1.gguf"
    model = {"uri": uri, "maxModelLen": 8192, "credentialsSecret": {"name": "hf-token"}}
    cluster.add(infd(model=model, replicas=1))
    headers = HeaderCache("https://mirror.test", transport=httpx.MockTransport(hub))
    await reconcile(cluster, "ns", "llama", headers)  # type: ignore[arg-type]
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    assert status["memoryPlan"]["source"] == "ggufHeader"
    assert status["memoryPlan"]["weightsGiB"] > 0
    assert (
        str(requests[0].url) == "https://mirror.test/acme/Llama-GGUF/resolve/main/llama-Q4_1.gguf"
    )
    assert requests[0].headers["authorization"] == "Bearer hf_abc"
    deployment = cluster.objects[("Deployment", "ns", "llama")]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["--model", "/models/model/llama-Q4_1.gguf"]

    await reconcile(cluster, "ns", "llama", headers)  # type: ignore[arg-type]
    assert len(requests) == 1 and cluster.secret_reads == 1, "a resync must not read it again"


async def test_unreadable_gguf_header_rolls_out_without_a_memory_plan() -> None:
    def hub(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401)

    cluster = MemoryCluster()
    cluster.add(infd(model={"uri": "hf://acme/Gated-GGUF/gated.gguf"}, replicas=1))
    headers = HeaderCache(transport=httpx.MockTransport(hub))
    await reconcile(cluster, "ns", "llama", headers)  # type: ignore[arg-type]
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    planned = next(c for c in status["conditions"] if c["type"] == "Planned")
    assert status["memoryPlan"] is None and planned["status"] == "True"
    assert (
        "memory not estimated (the GGUF header of hf://acme/Gated-GGUF/gated.gguf"
        in (planned["message"])
    )
    assert "HTTP 401" in planned["message"] and "set model.hints" in planned["message"]
    assert cluster.applied == CHILDREN + ROUTER
    assert cluster.secret_reads == 0  # no credentialsSecret: unauthenticated


def test_owns_replicas_reads_managed_fields() -> None:
    from kvfleet_operator.reconcile import owns_replicas

    deployment = {
        "metadata": {
            "managedFields": [
                {
                    "manager": "kvfleet-operator",
                    "operation": "Apply",
                    "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}},
                },
                {"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": {}},
            ]
        }
    }
    assert owns_replicas(deployment, "kvfleet-operator")
    assert not owns_replicas(deployment, "kvfleet-autoscaler")
