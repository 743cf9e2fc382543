"""`spec.autoscaling` validation: what a user sees when the spec is wrong, and the defaults."""

import pytest
from pydantic import ValidationError

from kvfleet_operator.autoscaling.spec import AutoscalingSpec


def parse(**fields: object) -> AutoscalingSpec:
    body: dict[str, object] = {"maxReplicas": 4, "targets": {"kvCacheUtilization": 0.75}}
    body.update(fields)
    return AutoscalingSpec.model_validate(body)


def test_minimal_spec_gets_documented_defaults() -> None:
    spec = parse()
    assert (spec.min_replicas, spec.max_replicas) == (1, 4)
    assert (spec.controller, spec.source) == ("Builtin", "Direct")
    assert spec.behavior.stable_window_seconds == 60
    assert spec.behavior.panic_window_seconds == 10
    assert spec.behavior.scale_down.stabilization_window_seconds == 300
    assert spec.targets.names() == ["kv_cache_utilization"]


def test_camel_case_round_trip() -> None:
    body = {
        "minReplicas": 2,
        "maxReplicas": 8,
        "targets": {
            "generationTokenRate": {"capacityFraction": 0.7},
            "waitingRequestsPerReplica": 4,
            "ttft": {"quantile": 0.95, "seconds": 0.8},
        },
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 30}},
    }
    spec = AutoscalingSpec.model_validate(body)
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["targets"]["generationTokenRate"] == {"capacityFraction": 0.7}
    assert dumped["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 30
    assert AutoscalingSpec.model_validate(dumped) == spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"minReplicas": 5}, "minReplicas (5) must be <= autoscaling.maxReplicas (4)"),
        ({"targets": {}}, "set at least one of generationTokenRate"),
        ({"source": "Prometheus"}, "prometheus.url is required"),
        ({"controller": "KEDA"}, "prometheus.url is required"),
        ({"prometheus": {"url": "http://p:9090"}}, "only used with source: Prometheus"),
        (
            {"behavior": {"panicWindowSeconds": 120}},
            "panicWindowSeconds (120) must be <= behavior.stableWindowSeconds (60)",
        ),
        (
            {"behavior": {"syncPeriodSeconds": 10, "panicWindowSeconds": 15}},
            "at least twice behavior.syncPeriodSeconds",
        ),
        (
            {"targets": {"generationTokenRate": {"tokensPerSecond": 5, "capacityFraction": 0.5}}},
            "exactly one of tokensPerSecond or capacityFraction",
        ),
        (
            {"controller": "HPA", "targets": {"generationTokenRate": {"capacityFraction": 0.5}}},
            "HPA cannot express targets generationTokenRate.capacityFraction",
        ),
        (
            {"targets": {"promptTokenRate": {"capacityFraction": 0.5}}},
            "promptTokenRate.capacityFraction is not supported",
        ),
        ({"controller": "HPA", "targets": {"ttft": {"seconds": 1}}}, "cannot express targets ttft"),
        ({"targets": {"kvCacheUtilization": 1.5}}, "kvCacheUtilization"),
        ({"maxReplicas": 0}, "maxReplicas"),
        ({"replicas": 3}, "replicas"),
    ],
)
def test_invalid_specs_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as error:
        parse(**fields)
    assert message in str(error.value)
