"""Autoscaling end to end on the local control plane, with real engines standing in for pods.

kwok runs the pods and gives each an IP from its node's loopback CIDR (127.1.<node>.0/24); this
test starts one real `kvfleet serve` (tiny model, CPU) bound at each pod's IP:8000 and stops it
when the pod goes, so the operator's autoscaler scrapes real engines exactly as it would in a
cluster. `kvfleet bench serve` loads the first engine: its generation token rate goes over the
per-replica target, the Deployment grows and the new pods' engines serve; the load stops, and the
Deployment shrinks back only after the scale-down stabilization window. The InferenceDeployment's
spec (and generation) never changes: only the autoscaler's field manager writes replicas.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from autoscaling_scenario import (
    NAME,
    SCALE_DOWN_STABILIZATION_S,
    inference_deployment,
    start_load,
)
from engine_pods import EnginePods
from kvcluster.procs import stop_child
from kvcluster.testing import E2ECluster
from operator_process import OperatorProcess, llama_manifest
from operator_process import wait_logged as wait

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TARGET_TOKENS_PER_SECOND = (
    40  # per replica; one CPU engine under bench load does several times that
)


def test_token_rate_scales_up_and_back_down(
    cluster: E2ECluster,
    namespace: str,
    operator: OperatorProcess,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    kubectl = cluster.kubectl
    logs = [operator.log_path]
    manifest = inference_deployment(namespace, tiny_model, TARGET_TOKENS_PER_SECOND)
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))

    def infd() -> dict[str, Any]:
        return dict(kubectl.json("get", "infd", NAME, "-n", namespace, "--show-managed-fields"))

    def replicas() -> int:
        deployment = kubectl.json("get", "deployment", NAME, "-n", namespace)
        return int(deployment["spec"].get("replicas", 1))

    with EnginePods(cluster.kubectl, namespace, NAME, tiny_model, tmp_path) as engines:
        wait(lambda: engines.ready_ips(), 240, "the first engine to be ready", logs)
        before = infd()
        first_ip = engines.ready_ips()[0]
        assert replicas() == 1

        bench_log = (tmp_path / "bench.log").open("wb")
        bench = start_load(f"http://{first_ip}:8000", bench_log)
        try:
            wait(lambda: replicas() >= 2, 90, "a scale-up under load", logs)
            wait(lambda: replicas() == 3, 90, "the scale-up to maxReplicas", logs)
            wait(
                lambda: len(engines.ready_ips()) == 3,
                300,
                "engines on the new pods to serve",
                logs + [tmp_path / f"engine-{n}.log" for n in engines.started],
            )
            scaled_up = infd()
        finally:
            stop_child(bench, signal.SIGINT, 20)
            load_end = time.time()

        # Load gone: nothing may shrink before the stabilization window ends, then back to 1.
        first_down = None
        while time.time() < load_end + SCALE_DOWN_STABILIZATION_S + 120:
            if replicas() < 3:
                first_down = time.time()
                break
            time.sleep(0.5)
        assert first_down is not None, "never scaled down after the load stopped"
        assert first_down >= load_end + SCALE_DOWN_STABILIZATION_S - 1
        wait(lambda: replicas() == 1, 120, "the scale-down to minReplicas", logs)
        wait(lambda: len(engines.pods()) == 1, 60, "the extra pods to go", logs)
        after = infd()

    # GitOps: the spec is exactly what was applied; only status moved.
    assert after["spec"] == before["spec"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"] == 1
    for entry in after["metadata"]["managedFields"]:
        if entry.get("subresource") != "status":
            assert entry["manager"].startswith("kubectl"), entry

    # The replicas belong to the autoscaler's field manager, and status tells the story.
    deployment = kubectl.json("get", "deployment", NAME, "-n", namespace, "--show-managed-fields")
    owners = [
        entry["manager"]
        for entry in deployment["metadata"]["managedFields"]
        if "f:replicas" in entry.get("fieldsV1", {}).get("f:spec", {})
    ]
    assert "kvfleet-autoscaler" in owners
    assert "kvfleet-operator" not in owners
    history = after["status"]["autoscaling"]["history"]
    ups = [h for h in history if h["toReplicas"] > h["fromReplicas"]]
    downs = [h for h in history if h["toReplicas"] < h["fromReplicas"]]
    assert ups and "generationTokenRate" in ups[0]["reason"]
    assert downs and downs[-1]["toReplicas"] == 1
    signal_status = scaled_up["status"]["autoscaling"]["signals"][0]
    assert signal_status["name"] == "generationTokenRate"
    assert signal_status["target"] == TARGET_TOKENS_PER_SECOND
    limited = next(c for c in after["status"]["conditions"] if c["type"] == "ScalingLimited")
    assert limited["observedGeneration"] == 1


def test_controller_hpa_renders_an_hpa_the_api_server_accepts(
    cluster: E2ECluster, namespace: str, operator: OperatorProcess
) -> None:
    kubectl = cluster.kubectl
    autoscaling = {
        "minReplicas": 2,
        "maxReplicas": 5,
        "controller": "HPA",
        "targets": {"kvCacheUtilization": 0.75, "waitingRequestsPerReplica": 4},
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 120}},
    }
    manifest = llama_manifest(namespace, "viahpa", autoscaling=autoscaling)
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))

    def hpa() -> dict[str, Any] | None:
        found = kubectl.json("get", "hpa", "-n", namespace)["items"]
        return found[0] if found else None

    created = wait(hpa, 60, "the HorizontalPodAutoscaler", [operator.log_path])
    assert created["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "viahpa",
    }
    assert (created["spec"]["minReplicas"], created["spec"]["maxReplicas"]) == (2, 5)
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in created["spec"]["metrics"]}
    assert metrics == {
        "kvfleet_kv_cache_usage_ratio": {"type": "AverageValue", "averageValue": "750m"},
        "kvfleet_requests_waiting": {"type": "AverageValue", "averageValue": "4"},
    }
    assert created["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120
    owner = created["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("InferenceDeployment", "viahpa")
    # The HPA controller (no metrics API here, so it only enforces its bounds) now drives the
    # replicas: 1 -> minReplicas 2. The Builtin autoscaler stays out of it.
    wait(
        lambda: (
            kubectl.json("get", "deployment", "viahpa", "-n", namespace)["spec"]["replicas"] == 2
        ),
        90,
        "the HPA to raise the Deployment to minReplicas",
        [operator.log_path],
    )
    obj = kubectl.json("get", "infd", "viahpa", "-n", namespace)
    assert "autoscaling" not in (obj.get("status") or {})
    # This control plane serves no custom metrics API, so the HPA cannot read its metrics: the
    # InferenceDeployment says so (before, it showed Ready and nothing else).

    def limited() -> dict[str, Any] | None:
        infd = kubectl.json("get", "infd", "viahpa", "-n", namespace)
        # no status yet on a busy machine: the HPA can raise the replicas before the operator's
        # first status write lands
        conditions = (infd.get("status") or {}).get("conditions") or []
        found = [c for c in conditions if c["type"] == "ScalingLimited"]
        return found[0] if found and found[0]["status"] == "True" else None

    condition = wait(limited, 90, "ScalingLimited from the HPA", [operator.log_path])
    assert condition["reason"] == "FailedGetPodsMetric", condition
    assert condition["message"].startswith("HorizontalPodAutoscaler viahpa: "), condition
    assert "custom.metrics.k8s.io" in condition["message"], condition
