"""External actuators, pure: `controller: HPA` renders an autoscaling/v2 HorizontalPodAutoscaler
on Pods metrics, `controller: KEDA` a ScaledObject with Prometheus triggers. Both target the child
Deployment; the Builtin autoscaler then stays out of the way.

Both target the child workload (`target`: the Deployment, or the LeaderWorkerSet whose replicas
are groups; StatefulSet groups have no one object to scale, plan.py refuses HPA and KEDA there).
While spec.suspend holds the workload at zero (`paused`), the ScaledObject carries KEDA's
paused-replicas annotation at 0: without it KEDA scales a target below minReplicaCount back up,
and the reconciler scales it back to zero, over and over. An HPA needs nothing: it stops by
itself on a target at zero replicas (ScalingActive=False, ScalingDisabled).
HPA Pods metrics come from a custom-metrics adapter (e.g. prometheus-adapter) serving these names
per pod: kvfleet_kv_cache_usage_ratio, kvfleet_requests_waiting, and the rates
kvfleet_generation_tokens_per_second / kvfleet_prompt_tokens_per_second (adapter rules over the
`_total` counters; README "Autoscaling" has the rule).
"""

from __future__ import annotations

from typing import Any

from kvfleet_operator.autoscaling.spec import AutoscalingBehavior, AutoscalingSpec

Manifest = dict[str, Any]

HPA_METRICS = {  # signal -> per-pod metric name served by the custom-metrics adapter
    "generation_token_rate": "kvfleet_generation_tokens_per_second",
    "prompt_token_rate": "kvfleet_prompt_tokens_per_second",
    "kv_cache_utilization": "kvfleet_kv_cache_usage_ratio",
    "waiting_requests_per_replica": "kvfleet_requests_waiting",
}


# KEDA scales the target to this count and stops autoscaling it while the annotation is there;
# removing it resumes autoscaling.
KEDA_PAUSED_REPLICAS = "autoscaling.keda.sh/paused-replicas"

EXTERNAL_KIND = {  # (apiVersion, kind) of the object controller HPA / KEDA renders
    "HPA": ("autoscaling/v2", "HorizontalPodAutoscaler"),
    "KEDA": ("keda.sh/v1alpha1", "ScaledObject"),
}
EXTERNAL_KINDS = tuple(EXTERNAL_KIND.values())


def render_external_autoscaler(
    name: str,
    namespace: str,
    labels: dict[str, str],
    spec: AutoscalingSpec,
    target: dict[str, str] | None = None,
    *,
    paused: bool = False,
) -> Manifest:
    """The HPA or ScaledObject for `spec.controller` (HPA or KEDA), scaling `target`
    (apiVersion, kind, name; default the Deployment `name`); `paused`: spec.suspend holds the
    target at zero."""
    target = target or _deployment(name)
    if spec.controller == "HPA":
        return render_hpa(name, namespace, labels, spec, target)
    if spec.controller == "KEDA":
        return render_scaled_object(name, namespace, labels, spec, target, paused=paused)
    raise ValueError(f"controller {spec.controller!r} has no external object")


def render_hpa(
    name: str,
    namespace: str,
    labels: dict[str, str],
    spec: AutoscalingSpec,
    scale_target: dict[str, str] | None = None,
) -> Manifest:
    """An autoscaling/v2 HPA with one Pods metric (AverageValue) per configured target."""
    metrics = []
    for signal, metric_name in HPA_METRICS.items():
        target = getattr(spec.targets, signal)
        if target is None:
            continue
        value = target if isinstance(target, float | int) else target.tokens_per_second
        assert value is not None, "capacityFraction is rejected for HPA by AutoscalingSpec"
        metrics.append(
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": metric_name},
                    "target": {"type": "AverageValue", "averageValue": quantity(value)},
                },
            }
        )
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "scaleTargetRef": dict(scale_target or _deployment(name)),
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "metrics": metrics,
            "behavior": hpa_behavior(spec.behavior),
        },
    }


def render_scaled_object(
    name: str,
    namespace: str,
    labels: dict[str, str],
    spec: AutoscalingSpec,
    scale_target: dict[str, str] | None = None,
    *,
    paused: bool = False,
) -> Manifest:
    """A KEDA ScaledObject with one Prometheus trigger per configured target; `paused`: held
    at zero replicas (KEDA_PAUSED_REPLICAS)."""
    assert spec.prometheus is not None, "required for KEDA by AutoscalingSpec"
    window = f"{spec.behavior.stable_window_seconds}s"
    pods = f'namespace="{namespace}",pod=~"{name}-[a-z0-9]+-[a-z0-9]+"'
    targets = spec.targets
    triggers: list[tuple[str, str, str, float]] = []  # (name, metricType, query, threshold)
    for signal, trigger_name, counter in (
        (
            targets.generation_token_rate,
            "generation-tokens-per-second",
            "kvfleet_generation_tokens_total",
        ),
        (targets.prompt_token_rate, "prompt-tokens-per-second", "kvfleet_prompt_tokens_total"),
    ):
        if signal is None:
            continue
        rate = f"sum(rate({counter}{{{pods}}}[{window}]))"
        if signal.capacity_fraction is not None:
            capacity = f"avg(kvfleet_engine_capacity_tokens_per_second{{{pods}}})"
            triggers.append(
                (trigger_name, "AverageValue", f"{rate} / {capacity}", signal.capacity_fraction)
            )
        else:
            assert signal.tokens_per_second is not None
            triggers.append((trigger_name, "AverageValue", rate, signal.tokens_per_second))
    if targets.kv_cache_utilization is not None:
        query = f"sum(kvfleet_kv_cache_usage_ratio{{{pods}}})"
        triggers.append(
            ("kv-cache-utilization", "AverageValue", query, targets.kv_cache_utilization)
        )
    if targets.waiting_requests_per_replica is not None:
        query = f"sum(kvfleet_requests_waiting{{{pods}}})"
        triggers.append(
            ("waiting-requests", "AverageValue", query, targets.waiting_requests_per_replica)
        )
    for latency, label, histogram in (
        (targets.ttft, "ttft", "kvfleet_time_to_first_token_seconds"),
        (targets.tpot, "tpot", "kvfleet_inter_token_latency_seconds"),
    ):
        if latency is None:
            continue
        query = (
            f"histogram_quantile({latency.quantile:g}, "
            f"sum by (le) (rate({histogram}_bucket{{{pods}}}[{window}])))"
        )
        triggers.append((f"{label}-p{latency.quantile * 100:g}", "Value", query, latency.seconds))
    metadata: Manifest = {"name": name, "namespace": namespace, "labels": labels}
    if paused:
        metadata["annotations"] = {KEDA_PAUSED_REPLICAS: "0"}
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": dict(scale_target or _deployment(name)),
            "minReplicaCount": spec.min_replicas,
            "maxReplicaCount": spec.max_replicas,
            "pollingInterval": spec.behavior.sync_period_seconds,
            "advanced": {
                "horizontalPodAutoscalerConfig": {"behavior": hpa_behavior(spec.behavior)}
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "name": trigger_name,
                    "metricType": metric_type,
                    "metadata": {
                        "serverAddress": spec.prometheus.url,
                        "query": query,
                        "threshold": f"{threshold:g}",
                        "ignoreNullValues": "false",  # no data -> error -> HPA holds (not zero)
                    },
                }
                for trigger_name, metric_type, query, threshold in triggers
            ],
        },
    }


def _deployment(name: str) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}


def hpa_behavior(behavior: AutoscalingBehavior) -> Manifest:
    """HPA v2 `behavior` from ours: stabilization windows and the larger of the Pods/Percent
    policies per period."""

    def rules(stabilization: int, pods: int, percent: int, period: int) -> Manifest:
        policies = [{"type": "Pods", "value": pods, "periodSeconds": period}]
        if percent > 0:
            policies.append({"type": "Percent", "value": percent, "periodSeconds": period})
        return {
            "stabilizationWindowSeconds": stabilization,
            "selectPolicy": "Max",
            "policies": policies,
        }

    up, down = behavior.scale_up, behavior.scale_down
    return {
        "scaleUp": rules(
            up.stabilization_window_seconds,
            up.max_replicas_per_period,
            up.max_percent_per_period,
            up.period_seconds,
        ),
        "scaleDown": rules(
            down.stabilization_window_seconds,
            down.max_replicas_per_period,
            down.max_percent_per_period,
            down.period_seconds,
        ),
    }


def quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers as is, fractions in milli-units (0.75 -> 750m)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"
