"""HPA and KEDA rendering against golden YAML (regenerate with UPDATE_GOLDEN=1 after a deliberate
change)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from kvfleet_operator.autoscaling.actuators import quantity, render_hpa, render_scaled_object
from kvfleet_operator.autoscaling.spec import AutoscalingSpec

GOLDEN = Path(__file__).parent / "golden"
LABELS = {"kvfleet.io/deployment": "llama"}


def check_golden(name: str, manifest: dict) -> None:
    text = yaml.safe_dump(manifest, sort_keys=False, width=100)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path} differs: review, then UPDATE_GOLDEN=1"


def test_hpa_on_pods_metrics() -> None:
    spec = AutoscalingSpec.model_validate(
        {
            "minReplicas": 2,
            "maxReplicas": 8,
            "controller": "HPA",
            "targets": {
                "generationTokenRate": {"tokensPerSecond": 1500},
                "kvCacheUtilization": 0.75,
                "waitingRequestsPerReplica": 4,
            },
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 120}},
        }
    )
    hpa = render_hpa("llama", "team-a", LABELS, spec)
    check_golden("hpa", hpa)
    assert [m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]] == [
        "1500",
        "750m",
        "4",
    ]


def test_keda_scaled_object_with_prometheus_triggers() -> None:
    spec = AutoscalingSpec.model_validate(
        {
            "minReplicas": 1,
            "maxReplicas": 6,
            "controller": "KEDA",
            "prometheus": {"url": "http://prometheus.monitoring:9090"},
            "targets": {
                "generationTokenRate": {"capacityFraction": 0.7},
                "kvCacheUtilization": 0.8,
                "ttft": {"quantile": 0.9, "seconds": 0.5},
            },
        }
    )
    scaled = render_scaled_object("llama", "team-a", LABELS, spec)
    check_golden("keda", scaled)
    queries = {t["name"]: t["metadata"]["query"] for t in scaled["spec"]["triggers"]}
    assert queries["generation-tokens-per-second"].endswith(
        '/ avg(kvfleet_engine_capacity_tokens_per_second{namespace="team-a",'
        'pod=~"llama-[a-z0-9]+-[a-z0-9]+"})'
    )
    assert queries["ttft-p90"].startswith("histogram_quantile(0.9, sum by (le)")


def test_quantity() -> None:
    assert [quantity(v) for v in (4, 4.0, 0.75, 0.5, 1500)] == ["4", "4", "750m", "500m", "1500"]


def test_keda_without_its_crds_is_a_planning_problem_not_a_failing_apply() -> None:
    from kvfleet_operator.accelerators import resolve_accelerator
    from kvfleet_operator.model_catalog import model_architecture
    from kvfleet_operator.models import InferenceDeploymentSpec
    from kvfleet_operator.plan import ClusterFeatures, plan_deployment

    spec = InferenceDeploymentSpec.model_validate(
        {
            "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
            "resources": {"accelerator": "h100-80gb"},
            "autoscaling": {
                "maxReplicas": 4,
                "controller": "KEDA",
                "prometheus": {"url": "http://prometheus:9090"},
                "targets": {"kvCacheUtilization": 0.8},
            },
        }
    )
    profile = resolve_accelerator("h100-80gb", {})
    model = model_architecture(spec.model)
    without = plan_deployment("llama", spec, profile, model, ClusterFeatures(False, False))
    assert [p.reason for p in without.problems] == ["KedaUnavailable"]
    assert "scaledobjects.keda.sh" in without.problems[0].message
    with_keda = plan_deployment("llama", spec, profile, model, ClusterFeatures(False, False, True))
    assert with_keda.ok
