"""The operator end to end on the local control plane: CRDs and a sample in, GPU pods out, status
that tells the truth, GitOps-safe idempotency, rejection of specs that cannot run, garbage
collection and restarts. The operator runs as a subprocess under the ServiceAccount and RBAC of
manifests/, so the least-privilege role is exercised too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvcluster.kubectl import KubectlError
from kvcluster.procs import stop_child, tail
from kvcluster.testing import E2ECluster, wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "manifests" / "samples" / "small.yaml"
GPU = "nvidia.com/gpu"
# The cluster is shared by every e2e module: this operator watches only its own namespaces.
NAMESPACE_PREFIX = "e2e-op-"
T = TypeVar("T")


class Operator:
    """`kvfleet operator` as a subprocess with its own kubeconfig and log file."""

    def __init__(self, kubeconfig: Path, log_path: Path) -> None:
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfleet_cli", "operator", "-n", f"{NAMESPACE_PREFIX}*"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_child(self.proc, signal.SIGTERM, 20)
        self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)


@pytest.fixture(scope="module")
def operator(cluster: E2ECluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    kubectl = cluster.kubectl
    kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.wait_established("inferencedeployments.kvfleet.io", "acceleratorprofiles.kvfleet.io")
    for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml"):
        kubectl("apply", "--server-side", "-f", str(ROOT / "manifests" / name))
    created_service_monitor_crd = _ensure_service_monitor_crd(cluster)
    tmp = tmp_path_factory.mktemp("operator")
    op = Operator(cluster.service_account_kubeconfig(tmp), tmp / "operator.log")
    op.start()
    yield op
    op.stop()
    if created_service_monitor_crd:
        kubectl("delete", "crd", SERVICE_MONITOR_CRD, "--wait=false", check=False)


SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"


def _ensure_service_monitor_crd(cluster: E2ECluster) -> bool:
    """A stand-in for the Prometheus Operator's ServiceMonitor CRD (schema left open), so the
    operator's optional ServiceMonitor is exercised. Returns whether this call created it."""
    if cluster.kubectl("get", "crd", SERVICE_MONITOR_CRD, check=False).strip():
        return False
    schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    cluster.kubectl.apply(
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": SERVICE_MONITOR_CRD},
            "spec": {
                "group": "monitoring.coreos.com",
                "scope": "Namespaced",
                "names": {
                    "kind": "ServiceMonitor",
                    "plural": "servicemonitors",
                    "singular": "servicemonitor",
                    "listKind": "ServiceMonitorList",
                },
                "versions": [
                    {"name": "v1", "served": True, "storage": True,
                     "schema": {"openAPIV3Schema": schema}}
                ],
            },
        }
    )  # fmt: skip
    cluster.wait_established(SERVICE_MONITOR_CRD)
    return True


@pytest.fixture
def namespace(cluster: E2ECluster) -> Iterator[str]:
    """A fresh namespace that this module's operator watches (the shared fixture's are not)."""
    name = f"{NAMESPACE_PREFIX}{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def wait_for(operator: Operator, check: Callable[[], T | None], timeout: float, what: str) -> T:
    return wait_until(check, timeout, what, lambda: f"--- operator log ---\n{operator.log_tail()}")


def get(cluster: E2ECluster, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
    try:
        return dict(
            cluster.kubectl.json("get", kind, name, "-n", namespace, "--show-managed-fields")
        )
    except KubectlError as exc:
        if "NotFound" in str(exc):
            return None
        raise


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    conditions = ((obj or {}).get("status") or {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), None)


def ready_at(obj: dict[str, Any] | None, generation: int) -> bool:
    ready = condition(obj, "Ready")
    return bool(
        ready
        and obj is not None
        and obj["status"].get("observedGeneration") == generation
        and ready["status"] == "True"
        and ready["observedGeneration"] == generation
    )


def stalled_reason(cluster: E2ECluster, operator: Operator, namespace: str, name: str) -> str:
    def check() -> str | None:
        stalled = condition(get(cluster, namespace, "infd", name), "Stalled")
        return stalled["reason"] if stalled and stalled["status"] == "True" else None

    return wait_for(operator, check, 30, f"{name} Stalled")


def children(cluster: E2ECluster, namespace: str, name: str) -> dict[str, list[str]]:
    found = {}
    kinds = ("deployments", "services", "poddisruptionbudgets", "servicemonitors", "replicasets")
    for kind in kinds:
        items = cluster.kubectl.json(
            "get", kind, "-n", namespace, "-l", f"kvfleet.io/deployment={name}"
        )["items"]
        found[kind] = sorted(item["metadata"]["name"] for item in items)
    return found


def assert_spec_only_written_by_kubectl(obj: dict[str, Any]) -> None:
    assert obj["metadata"]["managedFields"], "managed fields are needed to check writers"
    assert not obj["metadata"].get("finalizers"), obj["metadata"]["finalizers"]
    for entry in obj["metadata"]["managedFields"]:
        if entry.get("subresource") != "status":
            assert entry["manager"].startswith("kubectl"), entry


def infd(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


HINTS_WITHOUT_CONTEXT = {
    "numParameters": 8_030_261_248, "numLayers": 32, "numAttentionHeads": 32,
    "numKeyValueHeads": 8, "headDim": 128,
}  # fmt: skip


def llama(**extra: Any) -> dict[str, Any]:
    spec = {
        "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
        "resources": {"accelerator": "h100-80gb"},
    }
    return {**spec, **extra}


def test_sample_lifecycle(cluster: E2ECluster, operator: Operator, namespace: str) -> None:
    kubectl = cluster.kubectl
    apply_sample = ("apply", "--server-side", "-n", namespace, "-f", str(SAMPLE))
    kubectl(*apply_sample)

    # A Deployment with the right GPU limit, on the fake H100 nodes, owned by the resource.
    deployment = wait_for(
        operator, lambda: get(cluster, namespace, "deployment", "llama-8b"), 30, "Deployment"
    )
    pod_spec = deployment["spec"]["template"]["spec"]
    engine = pod_spec["containers"][0]
    assert engine["resources"]["limits"][GPU] == "1"
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert engine["args"][engine["args"].index("--served-model-name") + 1] == "llama-8b"
    owner = deployment["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == (
        "InferenceDeployment",
        "llama-8b",
        True,
    )

    def running_pods() -> list[dict[str, Any]] | None:
        pods = kubectl.json("get", "pods", "-n", namespace, "-l", "kvfleet.io/deployment=llama-8b")
        running = [p for p in pods["items"] if p["status"].get("phase") == "Running"]
        return running or None

    pods = wait_for(operator, running_pods, 60, "engine pod Running")
    assert pods[0]["spec"]["nodeName"].startswith("kvfleet-gpu-")

    obj = wait_for(
        operator,
        lambda: (o := get(cluster, namespace, "infd", "llama-8b")) and ready_at(o, 1) and o,
        60,
        "Ready=True at generation 1",
    )
    status = obj["status"]
    assert status["endpoint"] == {
        "url": f"http://llama-8b-router.{namespace}.svc:8000/v1",
        "servedModelName": "llama-8b",
    }
    assert (
        status["replicasSummary"] == "1/1"
        and status["selector"] == "kvfleet.io/deployment=llama-8b"
    )
    assert status["memoryPlan"]["fits"] is True
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True",
        "Reconciling": "False",
        "Stalled": "False",
        "Planned": "True",
        "Available": "True",
    }
    assert "kopf" not in json.dumps(obj["metadata"].get("annotations", {}))
    events = kubectl.json(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=llama-8b"
    )["items"]
    assert {"Created", "Ready"} <= {e["reason"] for e in events}
    printed = kubectl("get", "infd", "llama-8b", "-n", namespace)
    columns = printed.splitlines()[1].split()
    assert columns[:8] == [
        "llama-8b",
        "llama-8b",
        "True",
        "1/1",
        "h100-80gb",
        "1",
        "none",
        "Manual",
    ]

    # Applying the same file again changes nothing and starts no reconcile loop (once the
    # rollout's last child events are handled: Ready can be written before them).
    versions = _settled_versions(cluster, namespace)
    before = get(cluster, namespace, "infd", "llama-8b")
    kubectl(*apply_sample)
    for _ in range(15):
        now = _resource_versions(cluster, namespace)
        if now != versions:
            after = get(cluster, namespace, "infd", "llama-8b")
            pytest.fail(
                f"resource versions {versions} -> {now} after re-applying the same file; "
                f"status before {before and before.get('status')}, after "
                f"{after and after.get('status')}\n{operator.log_tail()}"
            )
        time.sleep(2)

    # A spec change rolls the Deployment; observedGeneration follows.
    old_template_generation = deployment["metadata"]["generation"]
    patch = {"spec": {"engine": {"maxNumSeqs": 64}}}
    kubectl("patch", "infd", "llama-8b", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    deployment = wait_for(
        operator,
        lambda: (
            (d := get(cluster, namespace, "deployment", "llama-8b"))
            and d["metadata"]["generation"] > old_template_generation
            and d
        ),
        30,
        "the Deployment to change",
    )
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "64"
    wait_for(
        operator,
        lambda: ready_at(get(cluster, namespace, "infd", "llama-8b"), 2),
        60,
        "Ready=True at generation 2",
    )
    assert len(children(cluster, namespace, "llama-8b")["replicasets"]) == 2
    events = kubectl.json(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=llama-8b"
    )["items"]
    assert "RolloutStarted" in {e["reason"] for e in events}

    # An operator restart creates no duplicates and writes no spec.
    before = children(cluster, namespace, "llama-8b")
    uid = deployment["metadata"]["uid"]
    operator.stop()
    operator.start()
    time.sleep(20)  # resume handlers and one resync timer
    assert children(cluster, namespace, "llama-8b") == before
    for kind in ("deployments", "services", "poddisruptionbudgets", "servicemonitors"):
        assert before[kind] == ["llama-8b"], before
    obj = get(cluster, namespace, "infd", "llama-8b")
    assert obj is not None and obj["metadata"]["generation"] == 2 and ready_at(obj, 2)
    assert get(cluster, namespace, "deployment", "llama-8b")["metadata"]["uid"] == uid
    assert_spec_only_written_by_kubectl(obj)

    # Deleting the resource garbage-collects every child.
    kubectl("delete", "infd", "llama-8b", "-n", namespace)
    wait_for(
        operator,
        lambda: not any(children(cluster, namespace, "llama-8b").values()),
        60,
        "children to be garbage-collected",
    )


def test_accelerator_profile_object(
    cluster: E2ECluster, operator: Operator, namespace: str
) -> None:
    """A cluster AcceleratorProfile: its resource name, node selector and memory are used."""
    profile_name = f"lab-{namespace}"
    cluster.kubectl.apply(
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "AcceleratorProfile",
            "metadata": {"name": profile_name},
            "spec": {
                "memoryGiB": 80,
                "computeCapability": "9.0",
                "devicesPerNode": 8,
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            },
        }
    )
    try:
        spec = llama(replicas=1, resources={"accelerator": profile_name})
        cluster.kubectl.apply(infd(namespace, "lab", spec))
        obj = wait_for(
            operator,
            lambda: (o := get(cluster, namespace, "infd", "lab")) and ready_at(o, 1) and o,
            60,
            "Ready on a custom AcceleratorProfile",
        )
        assert obj["status"]["memoryPlan"]["availableGiB"] == 72
        deployment = get(cluster, namespace, "deployment", "lab")
        assert deployment is not None
        pod_spec = deployment["spec"]["template"]["spec"]
        assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert "tolerations" not in pod_spec or pod_spec["tolerations"] == []
    finally:
        cluster.kubectl("delete", "acceleratorprofile", profile_name, check=False)


def _owns_replicas(obj: dict[str, Any], manager: str) -> bool:
    return any(
        entry["manager"] == manager and "f:replicas" in entry["fieldsV1"].get("f:spec", {})
        for entry in obj["metadata"]["managedFields"]
    )


def _settled_versions(
    cluster: E2ECluster, namespace: str, quiet_s: float = 4.0, timeout_s: float = 60.0
) -> tuple[str, str, str]:
    """The resource versions once none has changed for quiet_s seconds."""
    deadline = time.monotonic() + timeout_s
    versions, since = _resource_versions(cluster, namespace), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _resource_versions(cluster, namespace)
        if now != versions:
            versions, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return versions
    raise AssertionError(f"resource versions still changing after {timeout_s:.0f} s: {versions}")


def _resource_versions(cluster: E2ECluster, namespace: str) -> tuple[str, str, str]:
    return tuple(  # type: ignore[return-value]
        cluster.kubectl(
            "get", kind, "llama-8b", "-n", namespace, "-o", "jsonpath={.metadata.resourceVersion}"
        )
        for kind in ("infd", "deployment", "service")
    )


def test_invalid_specs_are_rejected_or_stalled(
    cluster: E2ECluster, operator: Operator, namespace: str
) -> None:
    kubectl = cluster.kubectl
    rejected = {
        "parallelism.tensor must be one of 1, 2, 4, 8, 16": llama(parallelism={"tensor": 3}),
        "autoscaling.minReplicas must be <= autoscaling.maxReplicas": llama(
            autoscaling={
                "minReplicas": 3,
                "maxReplicas": 2,
                "targets": {"kvCacheUtilization": 0.7},
            }
        ),
        "set either replicas or autoscaling, not both": llama(
            replicas=1, autoscaling={"maxReplicas": 2, "targets": {"kvCacheUtilization": 0.7}}
        ),
        "autoscaling.controller: HPA cannot express targets": llama(
            autoscaling={
                "controller": "HPA",
                "maxReplicas": 2,
                "targets": {"ttft": {"seconds": 0.5}},
            }
        ),
        "autoscaling.minReplicas: 0 needs controller Builtin": llama(
            autoscaling={
                "controller": "HPA",
                "minReplicas": 0,
                "maxReplicas": 2,
                "targets": {"kvCacheUtilization": 0.7},
            }
        ),
        "autoscaling.prometheus.url is required": llama(
            autoscaling={
                "controller": "KEDA",
                "maxReplicas": 2,
                "targets": {"kvCacheUtilization": 0.7},
            }
        ),
        "at least twice syncPeriodSeconds": llama(
            autoscaling={
                "maxReplicas": 2,
                "targets": {"kvCacheUtilization": 0.7},
                "behavior": {"syncPeriodSeconds": 10, "panicWindowSeconds": 15},
            }
        ),
        "spec.model.uri": llama(model={"uri": "http://example.com/model"}),
        "engine.extraArgs: --quantization is set by the operator from quantization.weights": llama(
            engine={"extraArgs": ["--seed", "1", "--quantization=fp8"]}
        ),
        "cannot both be 0": llama(rollout={"maxUnavailable": 0}),
        "hints without maxPositionEmbeddings needs model.maxModelLen": llama(
            model={"uri": "hf://org/custom", "hints": HINTS_WITHOUT_CONTEXT}
        ),
        "spec.resources.cpu": llama(resources={"accelerator": "h100-80gb", "cpu": "two"}),
        "Unsupported value": llama(quantization={"weights": "int3"}),
        "quantization.kvCacheCalibration needs quantization.kvCache: fp8": llama(
            quantization={"kvCacheCalibration": "kv-calibration.safetensors"}
        ),
        "a path relative to the model": llama(
            quantization={"kvCache": "fp8", "kvCacheCalibration": "../other/kv.safetensors"}
        ),
        "engine.maxNumBatchedTokens must be >= engine.maxNumSeqs": llama(
            engine={"maxNumBatchedTokens": 100}
        ),
        "model.revision applies to hf:// models only": llama(
            model={"uri": "s3://models/llama", "revision": "v2", "maxModelLen": 8192}
        ),
        "model.credentialsSecret applies to hf:// and s3:// models only": llama(
            model={
                "uri": "pvc://models/llama",
                "credentialsSecret": {"name": "s"},
                "maxModelLen": 8192,
            }
        ),
        "must be a multiple of numKeyValueHeads": llama(
            model={
                "uri": "hf://org/custom",
                "maxModelLen": 8192,
                "hints": {**HINTS_WITHOUT_CONTEXT, "numAttentionHeads": 8, "numKeyValueHeads": 32},
            }
        ),
        "cannot be used with a file:// .gguf model": llama(
            model={"uri": "file:///var/models/llama.gguf"},
            quantization={"kvCache": "fp8", "kvCacheCalibration": "llama.kv.safetensors"},
        ),
    }
    for message, spec in rejected.items():
        with pytest.raises(KubectlError) as error:
            kubectl.apply(infd(namespace, "bad", spec))
        assert message in str(error.value), str(error.value)

    fp8_a100 = llama(quantization={"weights": "fp8"}, resources={"accelerator": "a100-80gb"})
    kubectl.apply(infd(namespace, "fp8-a100", fp8_a100))
    too_large = llama(model={"uri": "hf://meta-llama/Llama-3.1-70B-Instruct", "maxModelLen": 8192})
    kubectl.apply(infd(namespace, "too-large", too_large))
    # Tensor parallel 16 is in the API but not in the engine: planned, then held back.
    tp16 = llama(
        model={"uri": "hf://meta-llama/Llama-3.1-70B-Instruct", "maxModelLen": 8192,
               "servedModelName": "llama-70b"},
        parallelism={"tensor": 16},
    )  # fmt: skip
    kubectl.apply(infd(namespace, "llama-70b", tp16))

    queue0 = llama(
        routing={"queueSize": 0},
        autoscaling={"minReplicas": 0, "maxReplicas": 2, "targets": {"kvCacheUtilization": 0.7}},
    )
    kubectl.apply(infd(namespace, "queue0", queue0))
    bad_profile = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "AcceleratorProfile",
        "metadata": {"name": "bad-profile"},
        "spec": {"memoryGiB": 80, "computeCapability": "9.0",
                 "tolerations": [{"key": "gpu", "operator": "Exists", "value": "x"}]},
    }  # fmt: skip
    with pytest.raises(KubectlError, match="value must be empty with operator Exists"):
        kubectl.apply(bad_profile)

    assert stalled_reason(cluster, operator, namespace, "queue0") == "InvalidAutoscaling"
    assert stalled_reason(cluster, operator, namespace, "fp8-a100") == "UnsupportedQuantization"
    assert stalled_reason(cluster, operator, namespace, "too-large") == "InsufficientGPUMemory"
    assert stalled_reason(cluster, operator, namespace, "llama-70b") == "FeatureUnavailable"
    stalled = condition(get(cluster, namespace, "infd", "too-large"), "Stalled")
    assert stalled is not None and "needs 135.42 GiB per GPU" in stalled["message"]
    large = get(cluster, namespace, "infd", "llama-70b")
    assert large is not None and large["status"]["memoryPlan"]["fits"] is True
    assert large["status"]["topology"]["gpusPerReplica"] == 16
    assert large["status"]["topology"]["kind"] == "StatefulSet"
    # Nothing is rolled out for a spec that cannot run.
    assert kubectl.json("get", "deployments", "-n", namespace)["items"] == []
    assert kubectl.json("get", "statefulsets", "-n", namespace)["items"] == []

    # servedModelName is immutable.
    renamed = {"spec": {"model": {"servedModelName": "other"}}}
    with pytest.raises(KubectlError, match="servedModelName is immutable"):
        kubectl("patch", "infd", "llama-70b", "-n", namespace, "--type=merge", "-p",
                json.dumps(renamed))  # fmt: skip


def test_replicas_scale_subresource_and_autoscaler_ownership(
    cluster: E2ECluster, operator: Operator, namespace: str
) -> None:
    kubectl = cluster.kubectl
    kubectl.apply(infd(namespace, "fixed", llama(replicas=1)))
    wait_for(
        operator, lambda: get(cluster, namespace, "deployment", "fixed"), 30, "fixed Deployment"
    )
    kubectl("scale", "infd", "fixed", "-n", namespace, "--replicas=2")
    wait_for(
        operator,
        lambda: (
            (d := get(cluster, namespace, "deployment", "fixed")) and d["spec"]["replicas"] == 2
        ),
        30,
        "kubectl scale to reach the Deployment",
    )

    # Switching to autoscaling hands the current count to the autoscaler instead of letting
    # the Deployment fall back to 1 replica when the reconciler stops applying the field.
    switch = {"spec": {"replicas": None, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 3, "targets": {"kvCacheUtilization": 0.7}}}}  # fmt: skip
    kubectl("patch", "infd", "fixed", "-n", namespace, "--type=merge", "-p", json.dumps(switch))
    handed = wait_for(
        operator,
        lambda: (
            (d := get(cluster, namespace, "deployment", "fixed"))
            and not _owns_replicas(d, "kvfleet-operator")
            and d
        ),
        30,
        "the reconciler to release spec.replicas",
    )
    assert handed["spec"]["replicas"] == 2
    assert _owns_replicas(handed, "kvfleet-autoscaler")

    scaled = llama(autoscaling={"minReplicas": 1, "maxReplicas": 3,
                                "targets": {"kvCacheUtilization": 0.7}})  # fmt: skip
    kubectl.apply(infd(namespace, "auto", scaled))
    deployment = wait_for(
        operator, lambda: get(cluster, namespace, "deployment", "auto"), 30, "auto Deployment"
    )
    with pytest.raises(KubectlError, match="set either replicas or autoscaling"):
        kubectl("scale", "infd", "auto", "-n", namespace, "--replicas=2")
    for entry in deployment["metadata"]["managedFields"]:
        if entry["manager"] == "kvfleet-operator":
            assert "f:replicas" not in entry["fieldsV1"].get("f:spec", {}), entry
    obj = wait_for(
        operator,
        lambda: (
            (o := get(cluster, namespace, "infd", "auto")) and o.get("status", {}).get("scaling")
        ),
        30,
        "auto status",
    )
    assert obj == "Auto(1-3)"
