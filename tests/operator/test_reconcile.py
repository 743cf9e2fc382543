"""One reconcile against an in-memory API: children applied with owner references, status
written once, and nothing written when nothing changed."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import httpx
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from kvfleet_operator import api
from kvfleet_operator.apply import NotOwned, foreign_controller, secret_key_digest, with_owner
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.reconcile import reconcile
from status_patch import merge_patch

# Pipeline stages are planned and rendered before the engine serves them (conftest).


def conflict() -> ApiException:
    return ApiException(status=409, reason="Conflict")


class MemoryCluster:
    """The subset of apply.Cluster that reconcile uses, backed by a dict. Every write moves the
    object's resourceVersion; a status patch conditional on an older one is a 409, as from the
    API server."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.status_patches: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.applied: list[str] = []
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}
        self.secret_reads = 0
        self.deleted: list[str] = []  # "Kind/name"
        self.event_names: set[str | None] = set()  # events posted with their own name
        self.leader_worker_set = False  # whether the LeaderWorkerSet API is served
        self.versions = 0  # the last resourceVersion handed out
        self.created: list[str] = []  # "Kind/name" made by create
        self.refuse_creates: ApiException | None = None  # what create raises

    def add(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.objects[(obj["kind"], meta.get("namespace", ""), meta["name"])] = obj
        self.bump(obj)

    def bump(self, obj: dict[str, Any]) -> None:
        self.versions += 1
        obj["metadata"]["resourceVersion"] = str(self.versions)

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None):
        return copy.deepcopy(self.objects.get((kind, namespace or "", name)))

    async def list(self, api_version: str, kind: str, namespace=None, selector: str = ""):
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in self.objects.items()
            if k == kind
            and (namespace is None or ns == namespace)
            and wanted.items() <= (o["metadata"].get("labels") or {}).items()
        ]

    async def check_owned(self, manifest: dict[str, Any], owner: dict[str, Any]) -> None:
        """As apply.Cluster's: NotOwned for an object of the name another owner controls."""
        meta = manifest["metadata"]
        found = self.objects.get((manifest["kind"], meta.get("namespace") or "", meta["name"]))
        other = None if found is None else foreign_controller(found, owner)
        if other is not None:
            raise NotOwned(f"{manifest['kind']} {meta['name']} exists ({other})")

    async def has_crd(self, name: str) -> bool:
        return False

    async def serves(self, api_version: str, plural: str) -> bool:
        return self.leader_worker_set and plural == "leaderworkersets"

    async def delete(
        self, api_version: str, kind: str, name: str, namespace=None, *, propagation=None
    ) -> bool:
        self.deleted.append(f"{kind}/{name}")
        return self.objects.pop((kind, namespace or "", name), None) is not None

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        self.secret_reads += 1
        return self.secrets.get((namespace, name), {}).get(key)

    async def secret_digest(self, namespace: str, name: str, key: str) -> str | None:
        secret = self.objects.get(("Secret", namespace, name))
        return None if secret is None else secret_key_digest(secret, key)

    async def apply(self, manifest: dict[str, Any], *, owner=None, field_manager=""):
        manifest = with_owner(manifest, owner) if owner else manifest
        key = (manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        previous = self.objects.get(key)
        generation = (previous or {}).get("metadata", {}).get("generation", 0)
        if previous is None or previous.get("spec") != manifest.get("spec"):
            generation += 1
        stored = copy.deepcopy(manifest)
        stored["metadata"]["generation"] = generation
        if previous is not None and "status" in previous:  # apply leaves the status alone
            stored["status"] = previous["status"]
        self.objects[key] = stored
        self.bump(stored)
        self.applied.append(manifest["kind"])
        return copy.deepcopy(stored)

    async def create(self, manifest: dict[str, Any], *, owner) -> bool:
        if self.refuse_creates is not None:
            raise self.refuse_creates
        meta = manifest["metadata"]
        if (manifest["kind"], meta["namespace"], meta["name"]) in self.objects:
            return False  # 409
        self.add(copy.deepcopy(with_owner(manifest, owner)))
        self.created.append(f"{manifest['kind']}/{meta['name']}")
        return True

    async def patch_status(
        self, api_version, kind, name, namespace, status, *, resource_version=None
    ):
        obj = self.objects[(kind, namespace, name)]
        if resource_version not in (None, obj["metadata"]["resourceVersion"]):
            raise conflict()
        self.status_patches.append(status)
        obj["status"] = merge_patch(obj.get("status", {}), status)
        self.bump(obj)
        return copy.deepcopy(obj)

    async def post_event(self, involved, type_, reason, message, *, name=None) -> None:
        if name is not None and name in self.event_names:
            return  # the API server answers 409: one event
        self.event_names.add(name)
        self.events.append(reason)


# The engines' objects, then the router's (routing.enabled is the default).
CHILDREN = ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]
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


async def test_an_invalid_stored_accelerator_profile_is_named_as_invalid() -> None:
    """A profile stored before the CRD refused it is left out of planning; the deployment that
    names it said "neither built in nor an AcceleratorProfile in the cluster", which it is."""
    cluster = MemoryCluster()
    cluster.add({
        "apiVersion": api.API_VERSION, "kind": api.ACCELERATOR_PROFILE,
        "metadata": {"name": "my-gpu"},
        "spec": {"memoryGiB": 80, "computeCapability": "9.0",
                 "tolerations": [{"key": "gpu", "operator": "Exists", "value": "x"}]},
    })  # fmt: skip
    cluster.add(infd(resources={"accelerator": "my-gpu"}))
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.applied == []
    stalled = next(c for c in cluster.status_patches[0]["conditions"] if c["type"] == "Stalled")
    assert stalled["reason"] == "UnknownAccelerator"
    assert stalled["message"].startswith(
        "resources.accelerator='my-gpu': the AcceleratorProfile of that name is invalid "
        "(tolerations.0: Value error, tolerations: value must be empty with operator Exists)"
    )


async def test_hf_gguf_is_planned_from_its_header_read_once(write_gguf) -> None:
    gguf = write_gguf(layers=32, hidden=4096, heads=32, kv_heads=8, with_data=False, context=8192)
    data = gguf.read_bytes()
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


async def test_a_header_read_with_one_namespaces_token_is_not_anothers(write_gguf) -> None:
    """The cache was keyed by uri and revision only: a private repository's header, read with
    team-a's token, planned team-b's deployment of the same file, which has no token."""
    data = write_gguf(layers=32, hidden=4096, heads=32, kv_heads=8, with_data=False).read_bytes()

    def private_hub(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer hf_team_a":
            return httpx.Response(401)
        start, last = map(int, re.findall(r"\d+", request.headers["range"]))
        return httpx.Response(206, content=data[start : last + 1])

    uri = "hf://acme/Private-GGUF/private-Q4_1.gguf"
    headers = HeaderCache(transport=httpx.MockTransport(private_hub))
    team_a = MemoryCluster()
    team_a.secrets[("ns", "hf-token")] = {"HF_TOKEN": "hf_team_a"}
    model = {"uri": uri, "maxModelLen": 8192, "credentialsSecret": {"name": "hf-token"}}
    team_a.add(infd(model=model, replicas=1))
    await reconcile(team_a, "ns", "llama", headers)  # type: ignore[arg-type]
    planned = team_a.objects[("InferenceDeployment", "ns", "llama")]["status"]["memoryPlan"]
    assert planned["source"] == "ggufHeader"

    team_b = MemoryCluster()  # the same file, the same cache, no credentials
    team_b.add(infd(model={"uri": uri, "maxModelLen": 8192}, replicas=1))
    await reconcile(team_b, "ns", "llama", headers)  # type: ignore[arg-type]
    status = team_b.objects[("InferenceDeployment", "ns", "llama")]["status"]
    planned_b = next(c for c in status["conditions"] if c["type"] == "Planned")
    assert status.get("memoryPlan") is None and "HTTP 401" in planned_b["message"]


async def test_unreadable_gguf_header_rolls_out_without_a_memory_plan() -> None:
    def hub(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401)

    cluster = MemoryCluster()
    cluster.add(infd(model={"uri": "hf://acme/Gated-GGUF/gated.gguf"}, replicas=1))
    headers = HeaderCache(transport=httpx.MockTransport(hub))
    await reconcile(cluster, "ns", "llama", headers)  # type: ignore[arg-type]
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    planned = next(c for c in status["conditions"] if c["type"] == "Planned")
    assert status.get("memoryPlan") is None and planned["status"] == "True"
    assert (
        "memory not estimated (the GGUF header of hf://acme/Gated-GGUF/gated.gguf"
        in (planned["message"])
    )
    assert "HTTP 401" in planned["message"] and "set model.hints" in planned["message"]
    assert cluster.applied == CHILDREN + ROUTER
    assert cluster.secret_reads == 0  # no credentialsSecret: unauthenticated


def test_owns_replicas_reads_managed_fields() -> None:
    from kvfleet_operator.handover import owns_replicas

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


TWO_NODES = {"tensor": 8, "pipeline": 2}
LLAMA_405B = {"uri": "hf://meta-llama/Llama-3.1-405B-Instruct", "maxModelLen": 8192}


def group_pod(cluster: MemoryCluster, group: int, rank: int, restarts: int = 0) -> None:
    """A pod of StatefulSet group `group` as its controller would create it."""
    cluster.add({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"llama-group-{group}-{rank}", "namespace": "ns", "labels": {
            "kvfleet.io/deployment": "llama", "kvfleet.io/group": str(group),
            "apps.kubernetes.io/pod-index": str(rank), "controller-revision-hash": "r1"}},
        "status": {"phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"name": "engine", "restartCount": restarts}]},
    })  # fmt: skip


def controller_saw(cluster: MemoryCluster, revision: str = "r1") -> None:
    for (kind, _, _), obj in cluster.objects.items():
        if kind == "StatefulSet":
            generation = obj["metadata"]["generation"]
            obj["status"] = {"observedGeneration": generation, "updateRevision": revision}


async def test_native_groups_scale_recreate_and_leave_no_stale_workload() -> None:
    cluster = MemoryCluster()
    body = infd(replicas=1)  # Llama 3.1 8B: one GPU, then 16 over two nodes
    cluster.add(body)
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.applied == CHILDREN + ROUTER

    # TP 8 x PP 2 outgrows a node: the Deployment gives way to a StatefulSet group.
    body["spec"]["parallelism"] = TWO_NODES
    body["metadata"]["generation"] = 2
    cluster.applied.clear()
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.applied == [
        "Service", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy", *ROUTER
    ]  # fmt: skip
    assert cluster.deleted == ["Deployment/llama"]
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    assert status["topology"]["kind"] == "StatefulSet"
    assert status["topology"]["nodesPerReplica"] == 2

    # Two groups, both ready: 2/2.
    body["spec"]["replicas"] = 2
    body["metadata"]["generation"] = 3
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    controller_saw(cluster)
    for group in (0, 1):
        for rank in (0, 1):
            group_pod(cluster, group, rank)
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    assert status["replicasSummary"] == "2/2", status
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", ready

    # A rank of group 1 restarted: every pod of group 1 is deleted, group 0 untouched.
    group_pod(cluster, 1, 1, restarts=1)
    cluster.deleted.clear()
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.deleted == ["Pod/llama-group-1-0", "Pod/llama-group-1-1"]
    assert "GroupsReplaced" in cluster.events

    # Back to one group: the second StatefulSet goes.
    body["spec"]["replicas"] = 1
    body["metadata"]["generation"] = 4
    cluster.deleted.clear()
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.deleted == ["StatefulSet/llama-group-1"]


async def test_turning_autoscaling_off_clears_what_the_autoscaler_wrote() -> None:
    """status.autoscaling and ScalingLimited go with spec.autoscaling: they no longer describe
    the deployment, and the old desiredReplicas would size the groups again (6 groups of 16
    GPUs) when autoscaling is turned back on with minReplicas 1."""
    auto = {"minReplicas": 1, "maxReplicas": 8, "targets": {"kvCacheUtilization": 0.8}}
    parallelism = {"tensor": 8, "pipeline": 2}  # 16 GPUs: StatefulSet groups without LWS
    cluster = MemoryCluster()
    cluster.add(infd(parallelism=parallelism, autoscaling=auto))
    body = cluster.objects[("InferenceDeployment", "ns", "llama")]
    body["status"] = {  # the autoscaler's last tick
        "autoscaling": {"desiredReplicas": 6, "mode": "Panic"},
        "conditions": [
            {"type": "ScalingLimited", "status": "True", "reason": "InsufficientCapacity"}
        ],
    }
    await reconcile(cluster, "ns", "llama", HeaderCache())

    def groups() -> list[str]:
        return sorted(name for kind, _, name in cluster.objects if kind == "StatefulSet")

    assert len(groups()) == 6
    body["spec"] = infd(parallelism=parallelism, replicas=1)["spec"]
    body["metadata"]["generation"] = 2
    await reconcile(cluster, "ns", "llama", HeaderCache())
    assert body["status"].get("autoscaling") is None
    assert "ScalingLimited" not in [c["type"] for c in body["status"]["conditions"]]
    assert groups() == ["llama-group-0"]
    body["spec"] = infd(parallelism=parallelism, autoscaling=auto)["spec"]
    body["metadata"]["generation"] = 3
    await reconcile(cluster, "ns", "llama", HeaderCache())
    assert groups() == ["llama-group-0"]


async def test_a_feature_turned_off_takes_its_objects_with_it() -> None:
    """Children only some specs render go when a spec change stops rendering them: the router's
    six objects, the NetworkPolicy, the HPA (left alone it kept resizing the Deployment the
    reconciler sets back to spec.replicas)."""
    hpa = {"controller": "HPA", "minReplicas": 1, "maxReplicas": 3,
           "targets": {"kvCacheUtilization": 0.7}}  # fmt: skip
    cluster = MemoryCluster()
    cluster.add(infd(routing={"enabled": True}, networkPolicy={"enabled": True}, autoscaling=hpa))
    body = cluster.objects[("InferenceDeployment", "ns", "llama")]
    await reconcile(cluster, "ns", "llama", HeaderCache())
    kinds = {(kind, name) for kind, _, name in cluster.objects}
    assert {("HorizontalPodAutoscaler", "llama"), ("NetworkPolicy", "llama")} <= kinds
    assert {(kind, "llama-router") for kind in ROUTER} <= kinds
    cluster.add(  # not ours: never deleted
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "other", "namespace": "ns"},
        }
    )
    body["spec"] = infd(routing={"enabled": False}, networkPolicy={"enabled": False}, replicas=2)[
        "spec"
    ]
    body["metadata"]["generation"] = 2
    await reconcile(cluster, "ns", "llama", HeaderCache())
    left = {(kind, name) for kind, _, name in cluster.objects}
    assert left == {
        ("InferenceDeployment", "llama"),
        ("Deployment", "llama"),
        ("Service", "llama"),
        ("PodDisruptionBudget", "llama"),
        ("ServiceAccount", "other"),
    }
    deleted = len(cluster.deleted)
    await reconcile(cluster, "ns", "llama", HeaderCache())  # the same generation: nothing more
    assert len(cluster.deleted) == deleted


def test_every_optional_child_is_known() -> None:
    """optional_children lists every child a spec may or may not render (what prune_optional
    looks for): a spec with every option on renders nothing beyond the always-rendered ones and
    that list."""
    from kvfleet_operator.accelerators import resolve_accelerator
    from kvfleet_operator.model_catalog import model_architecture
    from kvfleet_operator.models import InferenceDeploymentSpec
    from kvfleet_operator.plan import ClusterFeatures, plan_deployment
    from kvfleet_operator.render import render_children
    from kvfleet_operator.topology_workloads import optional_children

    always = {("apps/v1", "Deployment", "llama"), ("v1", "Service", "llama"),
              ("policy/v1", "PodDisruptionBudget", "llama")}  # fmt: skip
    for controller in ("HPA", "KEDA"):
        autoscaling = {"controller": controller, "minReplicas": 1, "maxReplicas": 3,
                       "targets": {"kvCacheUtilization": 0.7},
                       "prometheus": {"url": "http://prometheus:9090"}}  # fmt: skip
        if controller == "HPA":
            del autoscaling["prometheus"]
        options = {"routing": {"enabled": True}, "networkPolicy": {"enabled": True}}
        spec = InferenceDeploymentSpec.model_validate(
            infd(**options, autoscaling=autoscaling)["spec"]
        )
        profile = resolve_accelerator(spec.resources.accelerator, {})
        features = ClusterFeatures(leader_worker_set=False, service_monitor=True, keda=True)
        plan = plan_deployment("llama", spec, profile, model_architecture(spec.model), features)
        children = render_children("llama", "ns", spec, plan, profile, service_monitor=True)
        rendered = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in children}
        assert rendered - always <= set(optional_children("llama")), rendered - always


async def test_a_child_the_api_server_refuses_is_reported_in_status() -> None:
    """An admission webhook or the API server's own validation refuses a rendered child (422):
    status says which object and why (Stalled/ApplyRejected, at the current generation)
    instead of staying at the last generation that applied, and the error still goes to the
    handler, whose retries continue."""

    class RefusingCluster(MemoryCluster):
        async def apply(self, manifest: dict[str, Any], *, owner=None, field_manager=""):
            if manifest["kind"] == "Deployment":
                body = json.dumps({"message": "admission webhook denied: no GPUs for team-a"})
                error = ApiException(status=422, reason="Unprocessable Entity")
                error.body = body
                raise error
            return await super().apply(manifest, owner=owner, field_manager=field_manager)

    cluster = RefusingCluster()
    cluster.add(infd(replicas=1, routing={"enabled": False}))
    with pytest.raises(ApiException):
        await reconcile(cluster, "ns", "llama", HeaderCache())
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    assert status["observedGeneration"] == 1
    stalled = next(c for c in status["conditions"] if c["type"] == "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "ApplyRejected")
    assert stalled["message"] == (
        "the API server refused Deployment llama: 422 Unprocessable Entity: admission webhook "
        "denied: no GPUs for team-a"
    )


class Killed(BaseException):
    """The operator process dying at this call (SIGKILL): nothing after it in the pass runs."""


async def _rolled_out_then_killed(kill_at: str) -> MemoryCluster:
    """A rollout (engine.maxNumSeqs changed) whose pass dies at `kill_at` ("event": before
    its RolloutStarted is posted; "status": after it, before the status that records it),
    then a restarted operator's pass."""

    class DyingCluster(MemoryCluster):
        armed = False

        async def post_event(self, involved, type_, reason, message, *, name=None) -> None:
            if self.armed and kill_at == "event" and reason == "RolloutStarted":
                raise Killed
            await super().post_event(involved, type_, reason, message, name=name)

        async def patch_status(self, api_version, kind, name, namespace, status, **options):
            if self.armed and kill_at == "status":
                raise Killed
            return await super().patch_status(api_version, kind, name, namespace, status, **options)

    cluster = DyingCluster()
    cluster.add(infd(replicas=1))
    await reconcile(cluster, "ns", "llama", HeaderCache())
    body = cluster.objects[("InferenceDeployment", "ns", "llama")]
    body["spec"]["engine"] = {"maxNumSeqs": 64}
    body["metadata"]["generation"] = 2
    cluster.armed = True
    with pytest.raises(Killed):
        await reconcile(cluster, "ns", "llama", HeaderCache())
    cluster.armed = False  # the restarted operator
    await reconcile(cluster, "ns", "llama", HeaderCache())
    return cluster


@pytest.mark.parametrize("kill_at", ["event", "status"])
async def test_a_rollout_is_told_once_across_an_operator_killed_mid_pass(kill_at: str) -> None:
    cluster = await _rolled_out_then_killed(kill_at)
    assert cluster.events.count("RolloutStarted") == 1, cluster.events
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    workload = cluster.objects[("Deployment", "ns", "llama")]
    assert status["workloadGeneration"] == workload["metadata"]["generation"] == 2


async def test_a_group_gets_a_random_step_channel_key_made_once() -> None:
    """The ranks of a multi-node replica answer the leader's challenge with a key of their own
    deployment's, not the engine's default: created once, kept across passes and rollouts."""
    cluster = MemoryCluster()
    cluster.add(infd(replicas=1, model=LLAMA_405B, parallelism=TWO_NODES))
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.created == ["Secret/llama-group-key"]
    secret = cluster.objects[("Secret", "ns", "llama-group-key")]
    key = secret["stringData"]["authkey"]
    assert len(key) >= 40 and secret["type"] == "Opaque"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"  # goes with the deployment
    body = cluster.objects[("InferenceDeployment", "ns", "llama")]
    body["spec"]["replicas"], body["metadata"]["generation"] = 2, 2
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.created == ["Secret/llama-group-key"]  # not made again, not changed
    assert cluster.objects[("Secret", "ns", "llama-group-key")]["stringData"]["authkey"] == key
    other = MemoryCluster()
    other.add(infd(replicas=1, model=LLAMA_405B, parallelism=TWO_NODES))
    await reconcile(other, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert other.objects[("Secret", "ns", "llama-group-key")]["stringData"]["authkey"] != key


async def test_a_group_key_left_by_an_earlier_deployment_of_the_name_is_waited_out() -> None:
    """Deleted and made again at once: the old Secret, still owned by the old uid, is not
    reused (the garbage collector would take its key from under the new groups)."""
    cluster = MemoryCluster()
    body = infd(replicas=1, model=LLAMA_405B, parallelism=TWO_NODES)
    old_owner = copy.deepcopy(body)
    old_owner["metadata"]["uid"] = "u-0"
    stale = {"apiVersion": "v1", "kind": "Secret", "stringData": {"authkey": "old"},
             "metadata": {"name": "llama-group-key", "namespace": "ns"}}  # fmt: skip
    cluster.add(with_owner(stale, old_owner))
    cluster.add(body)
    with pytest.raises(RuntimeError, match="belongs to an earlier InferenceDeployment"):
        await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert "StatefulSet" not in cluster.applied  # no group starts on a key about to vanish
    del cluster.objects[("Secret", "ns", "llama-group-key")]  # the garbage collector
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.created == ["Secret/llama-group-key"] and "StatefulSet" in cluster.applied


async def test_a_one_pod_replica_gets_no_group_key() -> None:
    cluster = MemoryCluster()
    cluster.add(infd(replicas=1))
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.created == []


async def test_no_right_to_create_secrets_leaves_the_groups_on_the_default_key_and_says_so():
    cluster = MemoryCluster()
    cluster.refuse_creates = ApiException(status=403, reason="Forbidden")
    cluster.add(infd(replicas=1, model=LLAMA_405B, parallelism=TWO_NODES))
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert "StatefulSet" in cluster.applied  # the group still rolls out
    assert "GroupKeyNotCreated" in cluster.events
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.events.count("GroupKeyNotCreated") == 1  # told once


async def test_leader_worker_set_when_served() -> None:
    cluster = MemoryCluster()
    cluster.leader_worker_set = True
    cluster.add(infd(replicas=2, model=LLAMA_405B, parallelism=TWO_NODES))
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.applied == [
        "LeaderWorkerSet", "Service", "PodDisruptionBudget", "NetworkPolicy", *ROUTER
    ]  # fmt: skip
    lws = cluster.objects[("LeaderWorkerSet", "ns", "llama-group")]
    assert lws["spec"]["replicas"] == 2 and cluster.events == ["Created"]
    status = cluster.objects[("InferenceDeployment", "ns", "llama")]["status"]
    assert status["topology"]["kind"] == "LeaderWorkerSet"


async def test_rotating_the_api_key_secret_rolls_the_pods() -> None:
    cluster = MemoryCluster()
    cluster.add(infd(replicas=1, auth={"apiKeySecretRef": {"name": "keys", "key": "api"}}))
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "keys", "namespace": "ns", "uid": "s-1"},
        "data": {"api": "c2stb2xk"},
    }
    cluster.add(secret)

    def template() -> dict[str, Any]:
        return cluster.objects[("Deployment", "ns", "llama")]["spec"]["template"]

    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    first = template()
    digest = first["metadata"]["annotations"]["kvfleet.io/api-key-digest"]
    assert len(digest) == 32 and "c2stb2xk" not in str(first["metadata"])
    env = {e["name"]: e for e in first["spec"]["containers"][0]["env"]}
    assert env["KVFLEET_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api"}

    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert template() == first, "an unchanged Secret must not roll the pods"

    def router_digest() -> str:
        router = cluster.objects[("Deployment", "ns", "llama-router")]["spec"]["template"]
        return str(router["metadata"]["annotations"]["kvfleet.io/api-key-digest"])

    assert router_digest() == digest
    cluster.add({**secret, "data": {"api": "c2stbmV3"}})  # rotated
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert template()["metadata"]["annotations"]["kvfleet.io/api-key-digest"] != digest
    assert router_digest() == template()["metadata"]["annotations"]["kvfleet.io/api-key-digest"]


async def test_a_rollout_is_told_even_when_a_later_child_fails_to_apply() -> None:
    """The operator dying (or an API error) after the Deployment's new template was applied:
    the next pass finds the template already changed, so the event must be out already."""
    cluster = MemoryCluster()
    cluster.add(infd(replicas=2))
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    obj = cluster.objects[("InferenceDeployment", "ns", "llama")]
    obj["spec"]["engine"] = {"maxNumSeqs": 64}
    obj["metadata"]["generation"] = 2
    apply = cluster.apply

    async def service_fails(manifest: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if manifest["kind"] == "Service":
            raise ConnectionResetError("the operator's connection went away")
        return await apply(manifest, **kwargs)

    cluster.apply = service_fails  # type: ignore[method-assign]
    with pytest.raises(ConnectionResetError):
        await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.events == ["Created", "RolloutStarted"]
    cluster.apply = apply  # type: ignore[method-assign]
    await reconcile(cluster, "ns", "llama", HeaderCache())  # type: ignore[arg-type]
    assert cluster.events == ["Created", "RolloutStarted"], "told once, not again"
