"""The AcceleratorProfile kind's spec: one device type and the nodes that carry it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvfleet_operator.wire import Model


class Toleration(Model):
    """A pod toleration, as in a Pod spec."""

    key: str | None = Field(default=None, description="Taint key; empty with Exists: any taint.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists (any value) or Equal (the value below); default Equal."
    )
    value: str | None = Field(default=None, description="Taint value to match with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty: every effect."
    )
    toleration_seconds: int | None = Field(
        default=None, description="With NoExecute: seconds the pod stays after the taint appears."
    )


class AcceleratorProfileSpec(Model):
    resource_name: str = Field(
        default="nvidia.com/gpu", description="Extended resource a pod requests for one device."
    )
    devices_per_node: int = Field(default=8, ge=1, le=64, description="Devices on one node.")
    memory_gib: float = Field(gt=0, description="Memory of one device, GiB.")
    compute_capability: str = Field(
        pattern=r"^[0-9]+\.[0-9]+$", description='CUDA compute capability, e.g. "9.0".'
    )
    node_selector: dict[str, Annotated[str, Field(description="Label value.")]] = Field(
        default_factory=dict, description="Labels of nodes that carry this device."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations for taints on those nodes."
    )
