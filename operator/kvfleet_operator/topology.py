"""Topology, pure: where the tensor × pipeline ranks of one replica run.

    world   = parallelism.tensor × parallelism.pipeline (one GPU per rank)
    world <= devicesPerNode  -> one pod with `world` GPUs (kind Deployment)
    otherwise                -> a group of pods, one per node:
                                nodes = ceil(world / devicesPerNode), world / nodes ranks each
                                (kind LeaderWorkerSet when its CRD is installed, else one
                                StatefulSet per replica)

The engine numbers ranks node by node (`--node-rank` R holds ranks R × per-node ..), so every
node must hold the same number of ranks: a world that does not split evenly over
ceil(world / devicesPerNode) nodes is refused with the numbers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, Overflow, localcontext

from kvfleet_operator.kinds.topology import QUANTITY_PATTERN
from kvfleet_operator.models import AcceleratorProfileSpec, InferenceDeploymentSpec, Topology

# /dev/shm per GPU of a pod: NCCL's shared-memory transport between the pod's ranks, and the
# engine's worker processes, use it; resources.sharedMemory is raised to this when smaller.
SHARED_MEMORY_PER_GPU_GIB = 2
_QUANTITY = re.compile(QUANTITY_PATTERN)  # group 1: the number; group 5: a suffix or e<power>
_SUFFIXES = {
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
    "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


@dataclass(frozen=True)
class TopologyError:
    """Why the ranks of one replica cannot be laid out on the accelerator's nodes."""

    message: str  # names the fields and the numbers


def plan_topology(
    spec: InferenceDeploymentSpec, profile: AcceleratorProfileSpec, *, leader_worker_set: bool
) -> tuple[Topology, TopologyError | None]:
    """The topology of one replica; `leader_worker_set`: whether the cluster serves the
    LeaderWorkerSet API (found by the apply layer)."""
    tensor, pipeline = spec.parallelism.tensor, spec.parallelism.pipeline
    world = tensor * pipeline
    per_node = profile.devices_per_node
    if world <= per_node:
        one_pod = Topology(
            kind="Deployment",
            tensor=tensor,
            pipeline=pipeline,
            gpus_per_replica=world,
            pods_per_replica=1,
            gpus_per_pod=world,
            nodes_per_replica=1,
        )
        return one_pod, None
    nodes = math.ceil(world / per_node)
    group = Topology(
        kind="LeaderWorkerSet" if leader_worker_set else "StatefulSet",
        tensor=tensor,
        pipeline=pipeline,
        gpus_per_replica=world,
        pods_per_replica=nodes,
        gpus_per_pod=world // nodes,
        nodes_per_replica=nodes,
    )
    if world % nodes:
        return group, TopologyError(
            f"parallelism.tensor × parallelism.pipeline = {tensor} × {pipeline} = {world} GPUs "
            f"needs {nodes} nodes of {per_node} devices ({spec.resources.accelerator}), but "
            f"{world} ranks do not split evenly over {nodes} nodes (every node runs the same "
            "number of ranks)"
        )
    return group, None


def shared_memory(requested: str, gpus_per_pod: int) -> str:
    """The /dev/shm size of a pod: resources.sharedMemory, raised to
    SHARED_MEMORY_PER_GPU_GIB per GPU of the pod when smaller."""
    floor = SHARED_MEMORY_PER_GPU_GIB * gpus_per_pod
    if quantity_bytes(requested) >= floor * 2**30:
        return requested
    return f"{floor}Gi"


def quantity_bytes(text: str) -> float:
    """A Kubernetes memory quantity ("8Gi", "512Mi", "16G", "1e9", "1000000") in bytes; the
    spec's schema admits no other text."""
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, tail = match[1], match[5] or ""
    with localcontext() as context:  # any power the schema admits: 1e9999999 is inf, no error
        context.traps[Overflow] = False
        value = Decimal(number)
        if tail in _SUFFIXES:  # "E" and "Ei" are exa and exbi; "E3", "e3" powers of ten
            value *= Decimal(_SUFFIXES[tail])
        elif tail:
            value *= Decimal(10) ** Decimal(tail[1:])
        return float(value)


def group_name(name: str) -> str:
    """The LeaderWorkerSet, or the headless Service of the StatefulSets."""
    return f"{name}-group"


def group_key_secret(name: str) -> str:
    """The Secret holding the key of the groups' step channel (`render_group.render_group_key`)."""
    return f"{name}-group-key"


def statefulset_name(name: str, index: int) -> str:
    """Replica `index`'s StatefulSet (one per replica), or a LeaderWorkerSet's worker set."""
    return f"{group_name(name)}-{index}"
