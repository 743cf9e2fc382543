"""Who may reach an InferenceDeployment's engines: `spec.auth` (an API key from a Secret) and
`spec.networkPolicy` (which pods and namespaces may open the engine port)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kvfleet_operator.wire import DNS_LABEL, Model, SecretName

SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
NamespaceName = Annotated[
    str, Field(max_length=63, pattern=DNS_LABEL, description="A namespace name (a DNS label).")
]


class SecretKeyReference(Model):
    name: SecretName
    key: str = Field(max_length=253, pattern=SECRET_KEY, description="The key in that Secret.")


class AuthSpec(Model):
    api_key_secret_ref: SecretKeyReference | None = Field(
        default=None,
        description="The API key clients must send as 'Authorization: Bearer <key>': the "
        "engine pods get this Secret key as KVFLEET_API_KEY, and rotating the Secret rolls them. "
        "/health, /ready and /metrics stay open. Unset: no authentication.",
    )


class NetworkPolicySpec(Model):
    enabled: bool = Field(
        default=True,
        description="Render a NetworkPolicy: the engine port is reachable only from this "
        "deployment's router pods, the operator (the built-in autoscaler reads /metrics), the "
        "monitoring namespace and allowedNamespaces. false: no NetworkPolicy.",
    )
    allowed_namespaces: list[NamespaceName] = Field(
        default_factory=list,
        max_length=64,
        description="Namespaces (by name) whose pods may call the engines directly; include "
        "this deployment's own namespace to let its other pods in.",
    )
    monitoring_namespace: NamespaceName = Field(
        default="monitoring",
        description="Namespace of the Prometheus that scrapes /metrics. /metrics shares the "
        "engine port, so its pods reach the API too (spec.auth guards that).",
    )
    operator_namespace: NamespaceName = Field(
        default="kvfleet-system",
        description="Namespace the kvfleet operator runs in (its autoscaler scrapes the pods).",
    )
