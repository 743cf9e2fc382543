"""`controller: KEDA` for real.

Against KEDA's own CRDs (from the pinned module e2e/tools/keda builds; in `make test`): the
operator renders a ScaledObject that the API server validates against KEDA's schema.

With KEDA running (`make test-integrations`): KEDA's operator and metrics adapter (behind the
aggregation layer) turn the ScaledObject into an HPA, the HPA controller in
kube-controller-manager reads its Prometheus triggers through external.metrics.k8s.io from a real
Prometheus scraping real engines, and scales the InferenceDeployment 1 -> 3 -> 1 under load."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autoscaling_scenario import MAX_REPLICAS, NAME, inference_deployment, start_load
from engine_pods import EnginePods
from kvcluster.binaries import KEDA_SPEC, PROMETHEUS_SPEC, missing_specs
from kvcluster.keda import Keda, crd_files
from kvcluster.procs import stop_child, tail
from kvcluster.prometheus import Prometheus
from kvcluster.testing import E2ECluster, wait_until
from operator_process import OperatorProcess, llama_manifest

pytestmark = pytest.mark.e2e

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


def test_keda_controller_renders_a_scaled_object_keda_s_own_schema_accepts(
    cluster: E2ECluster, keda_crds: None, namespace: str, operator: OperatorProcess
) -> None:
    kubectl = cluster.kubectl
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "controller": "KEDA",
        "prometheus": {"url": "http://prometheus.monitoring:9090"},
        "targets": {
            "generationTokenRate": {"tokensPerSecond": 400},
            "kvCacheUtilization": 0.8,
            "ttft": {"seconds": 0.5, "quantile": 0.9},
        },
    }
    manifest = llama_manifest(namespace, "viakeda", autoscaling=autoscaling)
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))

    def scaled_object() -> dict[str, Any] | None:
        items = kubectl.json("get", "scaledobjects.keda.sh", "-n", namespace)["items"]
        return items[0] if items else None

    found = wait_until(scaled_object, 60, "the ScaledObject", operator.tail)
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


TARGET_TOKENS_PER_SECOND = 40  # per replica, as in test_autoscaling.py


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)  # as test_prometheus.py: three CPU engines on a busy 2-core machine
def test_keda_scales_through_the_hpa_controller_on_prometheus_data(
    cluster: E2ECluster,
    namespace: str,
    operator: OperatorProcess,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    if missing_specs(cluster.config.bin_root, (PROMETHEUS_SPEC, KEDA_SPEC)):
        pytest.skip("Prometheus or KEDA is not built: `make integrations-bin`")
    kubectl = cluster.kubectl
    with (
        Prometheus.start(cluster.config, tmp_path / "prometheus") as prom,
        Keda.start(cluster.config, kubectl, tmp_path / "keda") as keda,
    ):
        logs = [operator.log_path, prom.log_path, *keda.logs]

        def details() -> str:
            return "\n".join(f"--- {p.name} ---\n{tail(p, 25)}" for p in logs if p.exists())

        manifest = inference_deployment(namespace, tiny_model, TARGET_TOKENS_PER_SECOND)
        manifest["spec"]["autoscaling"]["controller"] = "KEDA"
        manifest["spec"]["autoscaling"]["prometheus"] = {"url": prom.url}
        kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))

        def replicas() -> int:
            deployment = kubectl.json("get", "deployment", NAME, "-n", namespace)
            return int(deployment["spec"]["replicas"])

        def hpa() -> dict[str, Any] | None:
            items = kubectl.json("get", "hpa", "-n", namespace)["items"]
            return items[0] if items else None

        with EnginePods(kubectl, namespace, NAME, tiny_model, tmp_path) as engines:
            wait_until(lambda: engines.ready_ips(), 240, "the first engine to be ready", details)
            created = wait_until(hpa, 90, "KEDA's HorizontalPodAutoscaler", details)
            owner = created["metadata"]["ownerReferences"][0]
            assert (owner["kind"], owner["name"]) == ("ScaledObject", NAME)
            assert {m["type"] for m in created["spec"]["metrics"]} == {"External"}

            def metric_read() -> bool:
                current = (hpa() or {}).get("status", {}).get("currentMetrics") or []
                return any(m.get("external", {}).get("current") for m in current)

            wait_until(metric_read, 120, "the HPA to read the external metric", details)
            bench_log = (tmp_path / "bench.log").open("wb")
            bench = start_load(f"http://{engines.ready_ips()[0]}:8000", bench_log)
            try:
                wait_until(lambda: replicas() == MAX_REPLICAS, 240,
                           "the HPA to scale to maxReplicas", details)  # fmt: skip
                wait_until(lambda: len(engines.ready_ips()) == MAX_REPLICAS, 300,
                           "engines on the new pods to serve", details)  # fmt: skip
            finally:
                stop_child(bench, signal.SIGINT, 20)
            wait_until(lambda: replicas() == 1, 240, "the HPA to scale back to 1", details)

        conditions = {c["type"]: c for c in (hpa() or {}).get("status", {}).get("conditions", [])}
        assert conditions["ScalingActive"]["status"] == "True", conditions
        events = kubectl(
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            "involvedObject.kind=HorizontalPodAutoscaler,reason=SuccessfulRescale",
        )
        assert "New size: 3" in events and "New size: 1" in events, events
        obj = kubectl.json("get", "infd", NAME, "-n", namespace)
        assert "autoscaling" not in (obj.get("status") or {})  # the Builtin autoscaler stayed out
