"""`helm install` of charts/kvfleet into the local control plane, then the sample
InferenceDeployment reaching Ready under the operator the release configured; `kubectl explain`
and `kubectl get -o wide` as a user sees them; `helm uninstall`.

The chart's operator pod is a kwok pod (no container runs), so the operator runs as a subprocess
with exactly the release's settings: the container's --namespace arguments and environment, and
a token of the release's ServiceAccount (so the chart's RBAC is what it may do). The release has
its own name (`--set name=...`), so it installs beside manifests/' kvfleet-operator."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcluster.binaries import HELM_SPEC, binary_paths
from kvcluster.kubectl import KubectlError
from kvcluster.procs import stop_child, tail
from kvcluster.testing import E2ECluster, wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvfleet"
SAMPLE = ROOT / "manifests" / "samples" / "small.yaml"
ENGINE_IMAGE = "registry.example/kvfleet-engine:e2e"


class Release:
    """One `helm install` of the chart; `helm(...)` runs helm against the cluster."""

    def __init__(self, cluster: E2ECluster, tmp: Path) -> None:
        suffix = uuid.uuid4().hex[:6]
        self.cluster, self.tmp = cluster, tmp
        self.name = f"kvfleet-helm-{suffix}"  # release, namespace and operator name
        self.watched = f"e2e-helm-{suffix}"
        self.binary = binary_paths(cluster.config.bin_root, (HELM_SPEC,))["helm"]

    def helm(self, *args: str) -> str:
        env = {**self.cluster.env, "HELM_CACHE_HOME": str(self.tmp / "helm-cache"),
               "HELM_CONFIG_HOME": str(self.tmp / "helm-config"),
               "HELM_DATA_HOME": str(self.tmp / "helm-data")}  # fmt: skip
        result = subprocess.run([str(self.binary), *args], env=env, capture_output=True, text=True)
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}{result.stderr}"
        return result.stdout


@pytest.fixture
def release(cluster: E2ECluster, tmp_path: Path) -> Iterator[Release]:
    rel = Release(cluster, tmp_path)
    if not rel.binary.is_file():
        message = "no helm binary: `make cluster-bin` builds it"
        if os.environ.get("KVFLEET_REQUIRE_HELM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    cluster.kubectl("create", "namespace", rel.watched)
    yield rel
    subprocess.run([str(rel.binary), "uninstall", rel.name, "-n", rel.name, "--ignore-not-found"],
                   env=cluster.env, capture_output=True)  # fmt: skip
    for namespace in (rel.watched, rel.name):
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _token_kubeconfig(cluster: E2ECluster, namespace: str, account: str, path: Path) -> Path:
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=1h").strip()
    entry = admin["clusters"][0]["cluster"]
    if "certificate-authority" in entry:
        ca = Path(entry.pop("certificate-authority")).read_bytes()
        entry["certificate-authority-data"] = base64.b64encode(ca).decode()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": entry}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": account}}],
    }))  # fmt: skip
    return path


def _operator_argv(container: dict[str, Any]) -> list[str]:
    """The container's arguments less its pod-local listeners (--liveness, --metrics-port)."""
    args, kept = list(container["args"]), []
    while args:
        flag = args.pop(0)
        if flag in ("--liveness", "--metrics-port"):
            args.pop(0)
            continue
        kept.append(flag)
    return [sys.executable, "-m", "kvfleet_cli", "operator", *kept]


def test_helm_install_runs_the_sample_to_ready_and_uninstalls(
    cluster: E2ECluster, release: Release, tmp_path: Path
) -> None:
    kubectl = cluster.kubectl
    transcript = release.helm(
        "install", release.name, str(CHART), "-n", release.name, "--create-namespace",
        "--set", f"name={release.name}", "--set", f"watchNamespaces={{{release.watched}}}",
        "--set", f"engine.image={ENGINE_IMAGE}", "--wait", "--timeout", "120s",
    )  # fmt: skip
    (tmp_path / "helm-install.txt").write_text(transcript)
    assert "STATUS: deployed" in transcript
    assert f"the operator watches\n{release.watched}." in transcript  # NOTES.txt
    assert f"kubectl apply -n {release.watched} -f manifests/samples/small.yaml" in transcript
    cluster.wait_established("inferencedeployments.kvfleet.io", "acceleratorprofiles.kvfleet.io")
    listed = yaml.safe_load(release.helm("list", "-n", release.name, "-o", "yaml"))
    assert [(r["name"], r["status"]) for r in listed] == [(release.name, "deployed")]

    deployment = kubectl.json("get", "deployment", release.name, "-n", release.name)
    assert deployment["status"].get("readyReplicas") == 2  # the kwok pods --wait waited for
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env == {"KVFLEET_ENGINE_IMAGE": ENGINE_IMAGE, "KVFLEET_ROUTER_IMAGE": container["image"]}
    fields = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "valueFrom" in e
    }
    assert fields == {"POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    env |= {"POD_NAMESPACE": release.name, "POD_NAME": f"{release.name}-operator-0"}

    kubeconfig = _token_kubeconfig(cluster, release.name, release.name, tmp_path / "sa.kubeconfig")
    log_path = tmp_path / "operator.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            _operator_argv(container),
            env={**os.environ, **env, "KUBECONFIG": str(kubeconfig)},
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        kubectl("apply", "--server-side", "-n", release.watched, "-f", str(SAMPLE))

        def ready() -> dict[str, Any] | None:
            try:
                obj = kubectl.json("get", "infd", "llama-8b", "-n", release.watched)
            except KubectlError:
                return None
            conditions = (obj.get("status") or {}).get("conditions", [])
            ok = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            return dict(obj) if ok else None

        obj = wait_until(ready, 120, "the sample to be Ready",
                         lambda: f"--- operator log ---\n{tail(log_path, 40)}")  # fmt: skip
        # It led on the release's Lease, with the release's RBAC (its Role for leases).
        lease = kubectl.json("get", "lease", release.name, "-n", release.name)
        assert lease["spec"]["holderIdentity"] == env["POD_NAME"]
    finally:
        stop_child(proc, signal.SIGTERM, 20)

    child = kubectl.json("get", "deployment", "llama-8b", "-n", release.watched)
    assert child["spec"]["template"]["spec"]["containers"][0]["image"] == ENGINE_IMAGE

    # What a user sees: -o wide with the endpoint and the memory plan, explain on status fields.
    wide = kubectl("get", "infd", "llama-8b", "-n", release.watched, "-o", "wide")
    header, row = wide.splitlines()[:2]
    assert header.split() == ["NAME", "MODEL", "READY", "REPLICAS", "ACCELERATOR", "TP",
                              "QUANTIZATION", "SCALING", "AGE", "REASON", "URL", "GPU-GIB",
                              "AVAIL-GIB", "FITS"]  # fmt: skip
    plan = obj["status"]["memoryPlan"]
    assert row.split()[-4:] == [obj["status"]["endpoint"]["url"], str(plan["requiredGiB"]),
                                str(plan["availableGiB"]), "true"]  # fmt: skip
    explained = kubectl("explain", "infd.status.memoryPlan.fits")
    assert "requiredGiB <= availableGiB" in explained
    described = kubectl("describe", "infd", "llama-8b", "-n", release.watched)
    rows = [line.split(None, 4) for line in described.split("\nEvents:")[1].splitlines()[3:]]
    events = {(row[0], row[1], row[3]): row[4] for row in rows if len(row) == 5}
    assert ("Normal", "Created", "kvfleet-operator") in events, described
    assert ("Normal", "Ready", "kvfleet-operator") in events, described

    release.helm("uninstall", release.name, "-n", release.name, "--wait")
    assert not kubectl("get", "clusterrole", release.name, "--ignore-not-found").strip()
    # CRDs stay (Helm never deletes what crds/ installed): the InferenceDeployment is still there
    assert kubectl("get", "infd", "llama-8b", "-n", release.watched, "-o", "name").strip()
