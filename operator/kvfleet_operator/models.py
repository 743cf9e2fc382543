"""Typed models of the kvfleet.io/v1alpha1 kinds. The CRDs in crds/ are generated from them
(`kvfleet crds`), and the reconciler parses every object through them. Each section of the spec
is a module of kvfleet_operator.kinds; this one assembles InferenceDeploymentSpec and re-exports
every name.

Field names are camelCase on the wire (aliases) and snake_case in Python. Rules that need more than
one field, or the old object, are CEL rules attached with `cel(...)`; they run in the API server.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from kvfleet_operator.access_spec import AuthSpec, NetworkPolicySpec
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.kinds.accelerator import AcceleratorProfileSpec, Toleration
from kvfleet_operator.kinds.autoscaling_rules import AUTOSCALING_RULES
from kvfleet_operator.kinds.cel import cel
from kvfleet_operator.kinds.model import (
    FILE_GGUF_CALIBRATION,
    GGUF_SUFFIX,
    GGUF_URI_MESSAGE,
    GGUF_URI_PATTERN,
    MODEL_URI_PATTERN,
    KVCacheQuantization,
    ModelHints,
    ModelSpec,
    QuantizationSpec,
    SecretReference,
    WeightQuantization,
)
from kvfleet_operator.kinds.routing import RoutingSpec, RoutingStrategy
from kvfleet_operator.kinds.serving import EngineSpec, RolloutSpec, SLASpec
from kvfleet_operator.kinds.status import (
    Condition,
    Endpoint,
    InferenceDeploymentStatus,
    MemoryPlan,
    MemorySource,
    Topology,
    WorkloadKind,
)
from kvfleet_operator.kinds.topology import TENSOR_PARALLEL_SIZES, ParallelismSpec, ResourcesSpec
from kvfleet_operator.wire import INT32_MAX, Model

__all__ = [
    "GGUF_SUFFIX",
    "GGUF_URI_MESSAGE",
    "GGUF_URI_PATTERN",
    "MODEL_URI_PATTERN",
    "TENSOR_PARALLEL_SIZES",
    "AcceleratorProfileSpec",
    "Condition",
    "Endpoint",
    "EngineSpec",
    "InferenceDeploymentSpec",
    "InferenceDeploymentStatus",
    "KVCacheQuantization",
    "MemoryPlan",
    "MemorySource",
    "ModelHints",
    "ModelSpec",
    "ParallelismSpec",
    "QuantizationSpec",
    "ResourcesSpec",
    "RolloutSpec",
    "RoutingSpec",
    "RoutingStrategy",
    "SLASpec",
    "SecretReference",
    "Toleration",
    "Topology",
    "WeightQuantization",
    "WorkloadKind",
    "cel",
]


class InferenceDeploymentSpec(Model):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!(has(self.replicas) && has(self.autoscaling))",
                "set either replicas or autoscaling, not both (with autoscaling the replica "
                "count belongs to the autoscaler, so kubectl scale is refused too)",
            ),
            (
                "!has(self.autoscaling) || "
                "self.autoscaling.minReplicas <= self.autoscaling.maxReplicas",
                "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
            ),
            *AUTOSCALING_RULES,
            (
                "!has(self.quantization) || !has(self.quantization.kvCacheCalibration) || "
                "!(self.model.uri.startsWith('file://') && self.model.uri.endsWith('.gguf'))",
                FILE_GGUF_CALIBRATION,
            ),
        )
    )

    model: ModelSpec = Field(description="What to serve.")
    quantization: QuantizationSpec = Field(
        default_factory=QuantizationSpec, description="Weight and KV-cache formats."
    )
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec, description="How one replica is split across GPUs."
    )
    resources: ResourcesSpec = Field(description="GPU type, CPU, memory, /dev/shm.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings.")
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=INT32_MAX,
        description="Fixed replica count (exclusive with autoscaling).",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None, description="Metric-driven replica count (exclusive with replicas)."
    )
    sla: SLASpec = Field(default_factory=SLASpec, description="Latency targets and concurrency.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout and draining.")
    routing: RoutingSpec = Field(
        default_factory=RoutingSpec, description="The router in front of the replicas."
    )
    suspend: bool = Field(default=False, description="Scale to zero, keep every object.")
    auth: AuthSpec = Field(default_factory=AuthSpec, description="API-key authentication.")
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="Which pods may reach the engines."
    )

    @model_validator(mode="after")
    def _calibration_reaches_the_pod(self) -> InferenceDeploymentSpec:
        # The CEL rule above, for objects stored before it existed.
        file_gguf = self.model.uri.startswith("file://") and self.model.is_gguf
        if self.quantization.kv_cache_calibration is not None and file_gguf:
            raise ValueError(FILE_GGUF_CALIBRATION)
        return self

    def effective_replicas(self) -> int | None:
        """Replicas the reconciler writes; None when the autoscaler owns them."""
        if self.suspend:
            return 0
        if self.autoscaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas
