"""InferenceDeployment's status: conditions, replicas, endpoint, topology and memory plan."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvfleet_operator.wire import Model

# Where the memory plan's model numbers came from (status.memoryPlan.source).
MemorySource = Literal["catalog", "ggufHeader", "hints"]


class Condition(Model):
    """One condition (Ready, Progressing, Degraded, Stalled, ScalingLimited)."""

    type: str = Field(description="Ready, Progressing, Degraded, Stalled or ScalingLimited.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="One CamelCase word, e.g. Available or InsufficientGPUMemory.")
    message: str = Field(default="", description="What happened and what to do, in words.")
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the condition was computed from."
    )
    last_transition_time: str = Field(
        description="When status last changed.", json_schema_extra={"format": "date-time"}
    )


class MemoryPlan(Model):
    # Optional in the schema only so that a status written before the field existed stays valid.
    source: MemorySource | None = Field(
        default=None,
        description="Where the model's numbers came from: catalog (built in), ggufHeader (read "
        "from the hf:// GGUF file's header) or hints (spec.model.hints).",
    )
    weights_gib: float = Field(description="Weights per GPU.")
    kv_cache_gib: float = Field(description="KV cache per GPU for the planned concurrency.")
    overhead_gib: float = Field(description="Activations and runtime reserve per GPU.")
    required_gib: float = Field(description="Sum of the above.")
    available_gib: float = Field(description="GPU memory × gpuMemoryUtilization.")
    fits: bool = Field(description="requiredGiB <= availableGiB.")


# The workload one replica runs as: one pod (Deployment), or a group of pods, one per node
# (LeaderWorkerSet when its CRD is installed, else one StatefulSet per replica).
WorkloadKind = Literal["Deployment", "LeaderWorkerSet", "StatefulSet"]


class Topology(Model):
    """How each replica is laid out on GPUs and pods."""

    kind: WorkloadKind = Field(
        description="The child workload: Deployment (one pod per replica), LeaderWorkerSet or "
        "StatefulSet (one per replica: a group of pods over several nodes)."
    )
    tensor: int = Field(description="Tensor-parallel size in effect.")
    pipeline: int = Field(description="Pipeline-parallel size in effect.")
    gpus_per_replica: int = Field(description="tensor × pipeline.")
    pods_per_replica: int = Field(description="Pods that make up one replica.")
    gpus_per_pod: int = Field(description="GPUs each of those pods requests.")
    # Optional in the schema only so that a status written before the field existed stays valid.
    nodes_per_replica: int | None = Field(
        default=None, description="Nodes one replica spans (one pod per node)."
    )


class Endpoint(Model):
    """Where clients reach the model."""

    url: str = Field(description="OpenAI-compatible base URL inside the cluster (the Service).")
    served_model_name: str = Field(description='The "model" clients send.')


class InferenceDeploymentStatus(Model):
    model_config = ConfigDict(extra="allow")

    observed_generation: int | None = Field(
        default=None, description="metadata.generation this status describes."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded, Stalled and ScalingLimited; one per type.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    replicas: int | None = Field(default=None, description="Replicas of the child workload.")
    ready_replicas: int | None = Field(default=None, description="Of those, ready to serve.")
    updated_replicas: int | None = Field(
        default=None, description="Of those, running the current spec."
    )
    replicas_summary: str | None = Field(default=None, description="ready/desired, for kubectl.")
    scaling: str | None = Field(default=None, description="Manual or Auto(min-max).")
    quantization: str | None = Field(default=None, description="Weight format in effect.")
    selector: str | None = Field(
        default=None, description="Label selector of the engine pods (the scale subresource's)."
    )
    endpoint: Endpoint | None = Field(default=None, description="Where clients reach the model.")
    topology: Topology | None = Field(
        default=None, description="How each replica is laid out on GPUs and pods."
    )
    memory_plan: MemoryPlan | None = Field(
        default=None, description="GPU memory per GPU the operator planned, and whether it fits."
    )
    workload_generation: int | None = Field(
        default=None,
        description="metadata.generation of the engine workload whose rollout was last told "
        "(a RolloutStarted event): a rollout a restarted operator had not told yet is told then.",
    )
    recreating_replicas: int | None = Field(
        default=None,
        description="Replicas of a LeaderWorkerSet deleted to change its group size while an "
        "autoscaler owned them: it is created again with as many, then this is cleared.",
    )
    autoscaling: dict[str, Any] | None = Field(
        default=None,
        description="Written by the autoscaler.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    kopf: dict[str, Any] | None = Field(
        default=None,
        description="The kopf framework's bookkeeping.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
