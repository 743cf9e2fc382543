"""`controller: KEDA` against KEDA's real CRDs (from the pinned module e2e/tools/keda builds):
the operator renders a ScaledObject that the API server validates against KEDA's own schema, and
the InferenceDeployment leaves KedaUnavailable once the CRDs exist."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcluster.keda import crd_files
from kvcluster.procs import stop_child, tail
from kvcluster.testing import E2ECluster, wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SCALED_OBJECT_CRD = "scaledobjects.keda.sh"


@pytest.fixture
def keda_crds(cluster: E2ECluster) -> Iterator[None]:
    created = not cluster.kubectl("get", "crd", SCALED_OBJECT_CRD, "--ignore-not-found").strip()
    for path in crd_files():
        cluster.kubectl("apply", "--server-side", "-f", str(path))
    cluster.wait_established(SCALED_OBJECT_CRD)
    yield
    if created:  # other tests assume a cluster without KEDA
        for path in crd_files():
            cluster.kubectl("delete", "-f", str(path), "--wait=false", check=False)


@pytest.fixture
def operator(cluster: E2ECluster, namespace: str, tmp_path: Path) -> Iterator[Path]:
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.wait_established("inferencedeployments.kvfleet.io")
    log_path = tmp_path / "operator.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_cli", "operator", "--namespace", namespace],
            env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    yield log_path
    stop_child(proc, signal.SIGTERM, 20)


def test_keda_controller_renders_a_scaled_object_keda_s_own_schema_accepts(
    cluster: E2ECluster, keda_crds: None, namespace: str, operator: Path
) -> None:
    kubectl = cluster.kubectl
    manifest = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "viakeda", "namespace": namespace},
        "spec": {
            "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
            "resources": {"accelerator": "h100-80gb"},
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 4,
                "controller": "KEDA",
                "prometheus": {"url": "http://prometheus.monitoring:9090"},
                "targets": {
                    "generationTokenRate": {"tokensPerSecond": 400},
                    "kvCacheUtilization": 0.8,
                    "ttft": {"seconds": 0.5, "quantile": 0.9},
                },
            },
        },
    }
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))

    def scaled_object() -> dict[str, Any] | None:
        items = kubectl.json("get", "scaledobjects.keda.sh", "-n", namespace)["items"]
        return items[0] if items else None

    found = wait_until(scaled_object, 60, "the ScaledObject",
                       lambda: f"--- operator log ---\n{tail(operator, 40)}")  # fmt: skip
    spec = found["spec"]
    assert spec["scaleTargetRef"]["name"] == "viakeda"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"generation-tokens-per-second", "kv-cache-utilization", "ttft-p90"}
    assert {t["type"] for t in triggers.values()} == {"prometheus"}
    assert triggers["ttft-p90"]["metricType"] == "Value"
    assert triggers["kv-cache-utilization"]["metadata"]["threshold"] == "0.8"
    assert all(t["metadata"]["serverAddress"] == "http://prometheus.monitoring:9090"
               for t in triggers.values())  # fmt: skip
    owner = found["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("InferenceDeployment", "viakeda")

    def not_stalled_on_keda() -> bool:
        obj = kubectl.json("get", "infd", "viakeda", "-n", namespace)
        conditions = (obj.get("status") or {}).get("conditions", [])
        return bool(conditions) and all(c.get("reason") != "KedaUnavailable" for c in conditions)

    wait_until(not_stalled_on_keda, 30, "no KedaUnavailable condition")
