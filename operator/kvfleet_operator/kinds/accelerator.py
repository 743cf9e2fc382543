"""The AcceleratorProfile kind's spec: one device type and the nodes that carry it."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvfleet_operator.kinds.cel import cel
from kvfleet_operator.wire import DNS_SUBDOMAIN as _DNS_SUBDOMAIN
from kvfleet_operator.wire import Model

# Kubernetes' own rules for what a profile puts into pods (apimachinery's validation), checked
# here so a profile the API server would refuse in every pod is refused when it is written.
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
# An extended resource: DOMAIN/NAME, e.g. nvidia.com/gpu, amd.com/gpu; not in Kubernetes' own
# domain, and not starting with "requests." (the quota prefix), which pods refuse.
RESOURCE_NAME_PATTERN = rf"^{_DNS_SUBDOMAIN}/{_NAME}$"
RESOURCE_NAME_RULE = (
    "!self.startsWith('requests.') && !self.startsWith('kubernetes.io/') && "
    "!self.contains('.kubernetes.io/')"
)
RESOURCE_NAME_MESSAGE = (
    "resourceName: an extended resource (DOMAIN/NAME, e.g. nvidia.com/gpu): not in the "
    "kubernetes.io domain and not starting with 'requests.'"
)
LABEL_KEY_PATTERN = rf"^({_DNS_SUBDOMAIN}/)?{_NAME}$"
LABEL_VALUE_PATTERN = rf"^({_NAME})?$"
LABEL_KEY_MESSAGE = (
    "nodeSelector: each key is a label key, [PREFIX/]NAME (NAME: up to 63 letters, digits, '-', "
    "'_' or '.', starting and ending with a letter or digit; PREFIX: a DNS subdomain)"
)
TOLERATION_RULES = (
    (
        "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
        "tolerations: value must be empty with operator Exists",
    ),
    (
        "has(self.key) && self.key != '' || has(self.operator) && self.operator == 'Exists'",
        "tolerations: an empty key needs operator Exists (it then matches every taint)",
    ),
    (
        "!has(self.tolerationSeconds) || has(self.effect) && self.effect == 'NoExecute'",
        "tolerations: tolerationSeconds needs effect NoExecute",
    ),
)


class Toleration(Model):
    """A pod toleration, as in a Pod spec."""

    model_config = ConfigDict(json_schema_extra=cel(*TOLERATION_RULES))

    key: str | None = Field(
        default=None,
        max_length=316,
        pattern=r"^$|" + LABEL_KEY_PATTERN,
        description="Taint key; empty with Exists: any taint.",
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists (any value) or Equal (the value below); default Equal."
    )
    value: str | None = Field(
        default=None,
        max_length=63,
        pattern=LABEL_VALUE_PATTERN,
        description="Taint value to match with Equal.",
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty: every effect."
    )
    toleration_seconds: int | None = Field(
        default=None, description="With NoExecute: seconds the pod stays after the taint appears."
    )

    @model_validator(mode="after")
    def _as_kubernetes_takes_it(self) -> Toleration:
        # The CEL rules above, for objects stored before they existed.
        if self.operator == "Exists" and self.value:
            raise ValueError(TOLERATION_RULES[0][1])
        if not self.key and self.operator != "Exists":
            raise ValueError(TOLERATION_RULES[1][1])
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(TOLERATION_RULES[2][1])
        return self


class AcceleratorProfileSpec(Model):
    resource_name: str = Field(
        default="nvidia.com/gpu",
        max_length=316,
        pattern=RESOURCE_NAME_PATTERN,
        description="Extended resource a pod requests for one device (DOMAIN/NAME).",
        json_schema_extra=cel((RESOURCE_NAME_RULE, RESOURCE_NAME_MESSAGE)),
    )
    devices_per_node: int = Field(default=8, ge=1, le=64, description="Devices on one node.")
    memory_gib: float = Field(gt=0, description="Memory of one device, GiB.")
    compute_capability: str = Field(
        pattern=r"^[0-9]+\.[0-9]+$", description='CUDA compute capability, e.g. "9.0".'
    )
    node_selector: dict[
        str,
        Annotated[
            str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN, description="Label value.")
        ],
    ] = Field(
        default_factory=dict,
        max_length=64,
        description="Labels of nodes that carry this device.",
        json_schema_extra=cel(
            (f"self.all(key, key.matches('{LABEL_KEY_PATTERN}'))", LABEL_KEY_MESSAGE)
        ),
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations for taints on those nodes."
    )

    @field_validator("resource_name")
    @classmethod
    def _extended_resource(cls, name: str) -> str:
        # The CEL rule above, for objects stored before it existed.
        domain = name.split("/", 1)[0]
        if (
            name.startswith("requests.")
            or domain == "kubernetes.io"
            or domain.endswith(".kubernetes.io")
        ):
            raise ValueError(RESOURCE_NAME_MESSAGE)
        return name

    @field_validator("node_selector")
    @classmethod
    def _label_keys(cls, labels: dict[str, str]) -> dict[str, str]:
        # The CEL rule above, for objects stored before it existed.
        if any(not re.match(LABEL_KEY_PATTERN, key) for key in labels):
            raise ValueError(LABEL_KEY_MESSAGE)
        return labels
