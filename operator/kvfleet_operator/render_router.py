"""Rendering the router, pure: `kvfleet router` in front of one InferenceDeployment's engines.

    ServiceAccount, Role, RoleBinding  the router reads the engine Service's EndpointSlices
                                       (get, list, watch; nothing else)
    Deployment                         routing.replicas router pods (operator image, `kvfleet
                                       router`), spread over nodes
    Service                            <name>-router:8000, what status.endpoint.url names
    PodDisruptionBudget                maxUnavailable 1
    (ServiceMonitor                    <name>-router, rendered by render.py beside the engines')

The router's pods carry `kvfleet.io/router`, never `kvfleet.io/deployment`: the engine
Deployment's selector, its Service and the autoscaler's pod list must not match them. With
spec.auth the router gets the engines' API key from the same Secret ($KVFLEET_API_KEY): it
requires the key from clients and sends it to the engines.
"""

from __future__ import annotations

from typing import Any

from kvfleet_operator import api
from kvfleet_operator.models import InferenceDeploymentSpec
from kvfleet_operator.plan import Plan
from kvfleet_operator.render_pod import API_KEY_ENV

ROUTER_LABEL = f"{api.GROUP}/router"
ROUTER_PORT = api.ENGINE_PORT  # clients change only the host when the router fronts them
PRE_STOP_SECONDS = 5  # endpoints drop the pod before it stops accepting
STREAM_DRAIN_SECONDS = 60  # in-flight streams finish before the pod is killed
Manifest = dict[str, Any]


def router_name(name: str) -> str:
    return f"{name}-router"


def router_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvfleet-router",
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/part-of": "kvfleet",
        "app.kubernetes.io/managed-by": api.FIELD_MANAGER,
        ROUTER_LABEL: name,
    }


def router_selector(name: str) -> dict[str, str]:
    return {ROUTER_LABEL: name}


def router_selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in router_selector(name).items())


def router_url(name: str, namespace: str) -> str:
    return f"http://{router_name(name)}.{namespace}.svc:{ROUTER_PORT}/v1"


def render_router(
    name: str,
    namespace: str,
    spec: InferenceDeploymentSpec,
    plan: Plan,
    pod_annotations: dict[str, str] | None = None,
) -> list[Manifest]:
    """The router's objects, in apply order (RBAC before the pod that uses it).
    `pod_annotations` go on its pod template (the API key's digest: a rotation rolls it)."""
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": router_metadata(name, namespace),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": router_metadata(name, namespace),
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": router_metadata(name, namespace),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": router_name(name),
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": router_name(name), "namespace": namespace}
            ],
        },
        render_router_deployment(name, namespace, spec, plan, pod_annotations),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": router_metadata(name, namespace),
            "spec": {
                "type": "ClusterIP",
                "selector": router_selector(name),
                "ports": [
                    {"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}
                ],
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": router_metadata(name, namespace),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": router_selector(name)}},
        },
    ]


def router_metadata(name: str, namespace: str) -> dict[str, Any]:
    return {"name": router_name(name), "namespace": namespace, "labels": router_labels(name)}


def router_args(name: str, namespace: str, spec: InferenceDeploymentSpec, plan: Plan) -> list[str]:
    """`kvfleet router` arguments: the engine Service `name` (its EndpointSlices) and the spec's
    routing settings."""
    routing = spec.routing
    mirrored = [  # the engine's own body settings, where engine.extraArgs sets them
        (flag, value)
        for flag in MIRRORED_ENGINE_FLAGS
        if (value := _engine_flag(spec.engine.extra_args, flag)) is not None
    ]
    return [
        "--deployment", name,
        "--namespace", namespace,
        "--served-model-name", plan.served_model_name,
        "--strategy", routing.strategy,
        "--queue-size", str(routing.queue_size),
        "--queue-timeout", str(routing.queue_timeout_seconds),
        "--port", str(ROUTER_PORT),
        *(part for pair in mirrored for part in pair),
    ]  # fmt: skip


# The engine's request-body limit and body timeout, which the router enforces first with the
# same defaults: an engine given a larger limit or a longer timeout in engine.extraArgs gets a
# router that lets those bodies through.
MIRRORED_ENGINE_FLAGS = ("--max-request-body-bytes", "--body-timeout")


def _engine_flag(args: list[str], flag: str) -> str | None:
    """The last value `flag` takes in `kvfleet serve` arguments (`--flag V` or `--flag=V`)."""
    value = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def render_router_deployment(
    name: str,
    namespace: str,
    spec: InferenceDeploymentSpec,
    plan: Plan,
    pod_annotations: dict[str, str] | None = None,
) -> Manifest:
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}]
    ref = spec.auth.api_key_secret_ref
    if ref is not None:
        secret = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
        env.append({"name": API_KEY_ENV, "valueFrom": secret})
    template_metadata: dict[str, Any] = {"labels": router_labels(name)}
    if pod_annotations:
        template_metadata["annotations"] = dict(pod_annotations)
    container = {
        "name": "router",
        "image": spec.routing.image or api.DEFAULT_ROUTER_IMAGE,
        "command": ["kvfleet", "router"],
        "args": router_args(name, namespace, spec, plan),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": {
            "requests": {"cpu": "250m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},  # no CPU limit: throttling would add latency
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": router_metadata(name, namespace),
        "spec": {
            "replicas": spec.routing.replicas,
            "selector": {"matchLabels": router_selector(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": template_metadata,
                "spec": {
                    "serviceAccountName": router_name(name),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 1000,
                        "runAsGroup": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "terminationGracePeriodSeconds": PRE_STOP_SECONDS + STREAM_DRAIN_SECONDS,
                    # One node's failure takes one router, not all: spread where the nodes allow.
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": router_selector(name)},
                        }
                    ],
                    "containers": [container],
                },
            },
        },
    }
