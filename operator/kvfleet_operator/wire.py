"""The base of the typed CRD models: camelCase field names on the wire, snake_case in Python,
unknown fields refused, parsed objects frozen."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# Replica counts are int32 in every workload, HPA and scale subresource: a larger one would
# be admitted here and refused (or wrapped negative) in the children.
INT32_MAX = 2**31 - 1

# Object names as Kubernetes checks them (apimachinery's validation): a DNS-1123 label
# (namespaces, Services) or subdomain (Secrets and most kinds). A name is also a segment of the
# API path the operator requests, so nothing else may reach one.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
SecretName = Annotated[
    str,
    Field(
        max_length=253,
        pattern=rf"^{DNS_SUBDOMAIN}$",
        description="Name of a Secret in the same namespace (a DNS subdomain: lower-case "
        "letters, digits, '-' and '.').",
    ),
]


def to_wire_name(field: str) -> str:
    """snake_case -> camelCase, keeping the unit GiB: memory_gib -> memoryGiB."""
    return to_camel(field).replace("Gib", "GiB")


class Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_wire_name, populate_by_name=True, extra="forbid", frozen=True
    )


# A container image reference: no whitespace (Kubernetes checks images only in pods, so a
# Deployment with " repo/img:1 " was admitted and every pod it made was refused).
IMAGE_PATTERN = r"^[^\s]+$"
