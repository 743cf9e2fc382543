"""Rendering, pure: the child objects of one InferenceDeployment as plain dicts.

Owner references are added by `apply`, the one place objects are sent to the API server.
`app.kubernetes.io/instance` is deliberately absent: Argo CD tracks its applications by that
label by default and would treat the children as its own.
"""

from __future__ import annotations

from typing import Any

from kvfleet_operator import api
from kvfleet_operator.autoscaling.actuators import render_external_autoscaler
from kvfleet_operator.models import AcceleratorProfileSpec, InferenceDeploymentSpec
from kvfleet_operator.plan import Plan
from kvfleet_operator.render_group import (
    leader_selector,
    render_leader_worker_set,
    render_rank_service,
    render_statefulsets,
)
from kvfleet_operator.render_network import render_network_policy
from kvfleet_operator.render_pod import ENGINE_TYPE_LABEL, annotate_pod_templates, pod_spec
from kvfleet_operator.render_router import render_router, router_metadata, router_selector
from kvfleet_operator.topology import group_name

# The pod-template annotation that carries a digest of the API key: a rotated Secret changes the
# template, so the workload rolls its pods onto the new key.
API_KEY_DIGEST_ANNOTATION = f"{api.GROUP}/api-key-digest"
Manifest = dict[str, Any]


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvfleet-engine",
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/part-of": "kvfleet",
        "app.kubernetes.io/managed-by": api.FIELD_MANAGER,
        api.DEPLOYMENT_LABEL: name,
    }


def selector(name: str) -> dict[str, str]:
    return {api.DEPLOYMENT_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def endpoint_url(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc:{api.ENGINE_PORT}/v1"


def render_children(
    name: str,
    namespace: str,
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
    *,
    service_monitor: bool,
    groups: int | None = None,
    api_key_digest: str | None = None,
) -> list[Manifest]:
    """Every child, in apply order. The workload follows `plan.topology.kind`: a Deployment, a
    LeaderWorkerSet, or (native groups) the headless Service and one StatefulSet per replica,
    `groups` of them when the autoscaler owns the count. `api_key_digest`: a digest of the
    spec.auth Secret's key for the pod templates, None when there is none or it could not be
    read (then a rotation rolls nothing)."""
    assert plan.topology is not None
    kind = plan.topology.kind
    workloads: list[Manifest]
    if kind == "Deployment":
        workloads = [render_deployment(name, namespace, spec, plan, profile)]
    elif kind == "LeaderWorkerSet":
        workloads = [render_leader_worker_set(name, namespace, labels(name), spec, plan, profile)]
    else:
        count = spec.effective_replicas()
        count = groups if count is None else count
        assert count is not None, "the autoscaler's group count is needed for StatefulSet groups"
        workloads = [
            render_rank_service(name, namespace, labels(name)),
            *render_statefulsets(name, namespace, labels(name), spec, plan, profile, count),
        ]
    digest = {API_KEY_DIGEST_ANNOTATION: api_key_digest} if api_key_digest is not None else {}
    if digest:
        for workload in workloads:
            annotate_pod_templates(workload, digest)
    children = [
        *workloads,
        render_service(name, namespace, leader_selector(kind)),
        render_pod_disruption_budget(name, namespace, group=kind != "Deployment"),
    ]
    if service_monitor:
        children.append(render_service_monitor(_metadata(name, namespace), selector(name)))
    if spec.autoscaling is not None and spec.autoscaling.controller != "Builtin":
        target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        if kind == "LeaderWorkerSet":
            target = {**target, "apiVersion": workloads[0]["apiVersion"], "kind": kind}
            target["name"] = group_name(name)
        children.append(
            render_external_autoscaler(
                name, namespace, labels(name), spec.autoscaling, target, paused=spec.suspend
            )
        )
    if spec.network_policy.enabled:
        children.append(
            render_network_policy(
                name,
                namespace,
                spec.network_policy,
                labels(name),
                selector(name),
                group=kind != "Deployment",
            )
        )
    if spec.routing.enabled:
        children += render_router(name, namespace, spec, plan, pod_annotations=digest)
        if service_monitor:  # the routers' kvfleet_router_* series, from their Service
            children.append(
                render_service_monitor(router_metadata(name, namespace), router_selector(name))
            )
    return children


def _metadata(name: str, namespace: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(name)}


def render_deployment(
    name: str,
    namespace: str,
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
) -> Manifest:
    assert plan.topology is not None and plan.topology.kind == "Deployment", plan.topology
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector(name)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable,
            },
        },
        "progressDeadlineSeconds": max(600, plan.startup_timeout_seconds + 120),
        "revisionHistoryLimit": 3,
        "template": {
            "metadata": {"labels": {**labels(name), **ENGINE_TYPE_LABEL}},
            "spec": pod_spec(spec, plan, profile),
        },
    }
    replicas = spec.effective_replicas()
    if replicas is not None:  # left out when the autoscaler owns it
        deployment_spec = {"replicas": replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace),
        "spec": deployment_spec,
    }


def render_service(name: str, namespace: str, leader: dict[str, str] | None = None) -> Manifest:
    """The OpenAI API of every replica; of a group, only its leader (`leader`: its labels)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace),
        "spec": {
            "type": "ClusterIP",
            "selector": {**selector(name), **(leader or {})},
            "ports": [
                {"name": "http", "port": api.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def render_pod_disruption_budget(name: str, namespace: str, *, group: bool = False) -> Manifest:
    """One voluntary disruption at a time. For groups (`group`) that is one group: evicting one
    rank takes its group down, its other pods turn unready, and while they are the budget lets
    no healthy pod of another group go; the broken group's own pods may (AlwaysAllow)."""
    pdb_spec: dict[str, Any] = {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}}
    if group:
        pdb_spec["unhealthyPodEvictionPolicy"] = "AlwaysAllow"
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace),
        "spec": pdb_spec,
    }


def render_service_monitor(metadata: dict[str, Any], match_labels: dict[str, str]) -> Manifest:
    """Prometheus Operator scraping of /metrics on the `http` port of the Services matching
    `match_labels` (the engines', or the routers')."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": match_labels},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }
