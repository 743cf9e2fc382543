"""The built-in accelerator catalog. An AcceleratorProfile object with the same name overrides an
entry (for example to change its node selector); any other name must exist as an object."""

from __future__ import annotations

from kvfleet_operator.models import AcceleratorProfileSpec, Toleration

PRODUCT_LABEL = "nvidia.com/gpu.product"

# GPU nodes are commonly tainted so that only pods that ask for GPUs land there.
_GPU_TOLERATION = Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")


def _nvidia(memory_gib: float, compute_capability: str, product: str) -> AcceleratorProfileSpec:
    return AcceleratorProfileSpec(
        resource_name="nvidia.com/gpu",
        devices_per_node=8,
        memory_gib=memory_gib,
        compute_capability=compute_capability,
        node_selector={PRODUCT_LABEL: product},
        tolerations=[_GPU_TOLERATION],
    )


# name -> profile; product strings are the values NVIDIA GPU Feature Discovery writes.
BUILTIN_ACCELERATORS: dict[str, AcceleratorProfileSpec] = {
    "a100-40gb": _nvidia(40, "8.0", "NVIDIA-A100-SXM4-40GB"),
    "a100-80gb": _nvidia(80, "8.0", "NVIDIA-A100-SXM4-80GB"),
    "h100-80gb": _nvidia(80, "9.0", "NVIDIA-H100-80GB-HBM3"),
    "h200-141gb": _nvidia(141, "9.0", "NVIDIA-H200"),
    "l4": _nvidia(24, "8.9", "NVIDIA-L4"),
    "l40s": _nvidia(48, "8.9", "NVIDIA-L40S"),
    "b200": _nvidia(180, "10.0", "NVIDIA-B200"),
}


def resolve_accelerator(
    name: str, profiles: dict[str, AcceleratorProfileSpec]
) -> AcceleratorProfileSpec | None:
    """The profile for `name`: a cluster AcceleratorProfile first, then the built-in catalog."""
    return profiles.get(name) or BUILTIN_ACCELERATORS.get(name)
