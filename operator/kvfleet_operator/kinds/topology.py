"""spec.parallelism and spec.resources: how one replica is split across GPUs, and on which."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

from kvfleet_operator.kinds.cel import cel
from kvfleet_operator.wire import Model

# A non-negative Kubernetes resource quantity (apimachinery's syntax): what the API server would
# take in a pod's resources, checked when the InferenceDeployment is written, not at apply.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _whole_number_as_quantity(value: object) -> object:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


# A quantity written as a string ("7500m", "64Gi") or, as in a pod's resources, a whole number
# (`cpu: 8`): the schema takes both (x-kubernetes-int-or-string) and the model keeps a string.
Quantity = Annotated[
    str,
    BeforeValidator(_whole_number_as_quantity),
    Field(
        max_length=32,
        pattern=QUANTITY_PATTERN,
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
            "minimum": 0,
        },
    ),
]

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16)
_SIZES = ", ".join(map(str, TENSOR_PARALLEL_SIZES))  # "1, 2, 4, 8, 16"
_SIZES_IN_WORDS = _SIZES.rsplit(", ", 1)[0] + " or " + str(TENSOR_PARALLEL_SIZES[-1])


class ParallelismSpec(Model):
    tensor: int = Field(
        default=1,
        ge=min(TENSOR_PARALLEL_SIZES),
        le=max(TENSOR_PARALLEL_SIZES),
        description=f"Tensor-parallel size: {_SIZES_IN_WORDS} GPUs per model shard group.",
        json_schema_extra=cel(
            (f"self in [{_SIZES}]", f"parallelism.tensor must be one of {_SIZES}")
        ),
    )
    pipeline: int = Field(default=1, ge=1, le=16, description="Pipeline-parallel stages.")


class ResourcesSpec(Model):
    accelerator: str = Field(
        max_length=63,
        description="Accelerator profile: a built-in name (a100-40gb, a100-80gb, h100-80gb, "
        "h200-141gb, l4, l40s, b200) or an AcceleratorProfile object.",
    )
    cpu: Quantity | None = Field(
        default=None, description="CPU request and limit (a Kubernetes quantity: 8, 7500m)."
    )
    memory: Quantity | None = Field(
        default=None, description="Memory request and limit (a Kubernetes quantity: 64Gi, 70G)."
    )
    shared_memory: Quantity = Field(
        default="8Gi", description="Size of /dev/shm (a Kubernetes quantity: 8Gi, 16G)."
    )
