"""Rendering, pure: the NetworkPolicy of one InferenceDeployment's engine pods.

Ingress to the engine port only from: this deployment's router pods (same namespace, its
`kvfleet.io/router` label: another deployment's router in the namespace is not let in), the
operator's pods (the built-in autoscaler scrapes /metrics), the monitoring namespace (Prometheus:
/metrics is on the engine port) and the namespaces `spec.networkPolicy.allowedNamespaces` names.
Everything else is denied; egress is left alone (hf:// and s3:// downloads need it).
The pods of a group (a replica over several pods) also reach each other on every port.
"""

from __future__ import annotations

from typing import Any

from kvfleet_operator import api
from kvfleet_operator.access_spec import NetworkPolicySpec
from kvfleet_operator.render_router import router_selector

Manifest = dict[str, Any]

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kvfleet-operator"}


def render_network_policy(
    name: str,
    namespace: str,
    spec: NetworkPolicySpec,
    pod_labels: dict[str, str],
    selector: dict[str, str],
    *,
    group: bool = False,
) -> Manifest:
    """The NetworkPolicy named `name` over the engine pods matched by `selector`. With `group`
    (a replica spread over several pods), the pods of the deployment also reach each other on
    every port: torch.distributed's rendezvous, the engine's step channel, gloo and NCCL."""
    sources: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": router_selector(name)}},
        {
            "namespaceSelector": _namespace(spec.operator_namespace),
            "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
        },
        {"namespaceSelector": _namespace(spec.monitoring_namespace)},
    ]
    allowed = dict.fromkeys(spec.allowed_namespaces)  # in order, once each
    sources += [{"namespaceSelector": _namespace(ns)} for ns in allowed]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": pod_labels},
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": sources, "ports": [{"protocol": "TCP", "port": api.ENGINE_PORT}]},
                *([{"from": [{"podSelector": {"matchLabels": dict(selector)}}]}] if group else []),
            ],
        },
    }


def _namespace(name: str) -> dict[str, Any]:
    return {"matchLabels": {NAMESPACE_NAME_LABEL: name}}
