"""Typed models of the kvfleet.io/v1alpha1 kinds. The CRDs in crds/ are generated from them
(`kvfleet crds`), and the reconciler parses every object through them.

Field names are camelCase on the wire (aliases) and snake_case in Python. Rules that need more than
one field, or the old object, are CEL rules attached with `cel(...)`; they run in the API server.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator

from kvfleet_operator.access_spec import AuthSpec, NetworkPolicySpec
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.wire import Model

MODEL_URI_PATTERN = r"^(hf|pvc|s3|file)://.+"
# A URI ending in .gguf names one GGUF file inside its source; any other URI names a directory.
GGUF_SUFFIX = ".gguf"
GGUF_URI_PATTERN = r"^(hf://[^/]+/[^/]+|pvc://[^/]+|s3://[^/]+|file://)/.+[.]gguf$"
GGUF_URI_MESSAGE = (
    "model.uri: a .gguf file is named hf://ORG/REPO/FILE.gguf, pvc://CLAIM/PATH/FILE.gguf, "
    "s3://BUCKET/KEY.gguf or file:///PATH/FILE.gguf"
)
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16)

WeightQuantization = Literal["none", "int8", "fp8", "int4-awq", "int4-gptq"]
RoutingStrategy = Literal["prefix", "least-load", "round-robin"]
KVCacheQuantization = Literal["auto", "fp8"]
# Where the memory plan's model numbers came from (status.memoryPlan.source).
MemorySource = Literal["catalog", "ggufHeader", "hints"]


def cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """x-kubernetes-validations for a model's JSON schema: (rule, message) pairs."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


class SecretReference(Model):
    name: str = Field(max_length=253, description="Name of a Secret in the same namespace.")


class ModelHints(Model):
    """Architecture numbers for models that are not in the built-in catalog; used to plan memory
    and to check tensor parallelism."""

    num_parameters: int = Field(ge=1, description="Total parameter count, e.g. 8030261248.")
    num_layers: int = Field(ge=1, description="Transformer layers (num_hidden_layers).")
    num_attention_heads: int = Field(ge=1, description="Query heads (num_attention_heads).")
    num_key_value_heads: int = Field(ge=1, description="KV heads (num_key_value_heads).")
    head_dim: int = Field(ge=1, description="Dimension of one attention head.")
    max_position_embeddings: int | None = Field(
        default=None, ge=1, description="Longest context the model supports."
    )
    hidden_size: int | None = Field(
        default=None,
        ge=1,
        description="Hidden size (hidden_size); numAttentionHeads × headDim when unset.",
    )
    intermediate_size: int | None = Field(
        default=None,
        ge=1,
        description="MLP width (intermediate_size). With it, quantized plans count the linear "
        "layers' weights apart from the embeddings and norms, which stay 16-bit; without it, "
        "every parameter counts as quantized.",
    )

    @property
    def hidden(self) -> int:
        return self.hidden_size or self.num_attention_heads * self.head_dim


class ModelSpec(Model):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "has(self.servedModelName) == has(oldSelf.servedModelName) && "
                "(!has(self.servedModelName) || self.servedModelName == oldSelf.servedModelName)",
                "model.servedModelName is immutable: it cannot be added, removed or changed "
                "after creation (clients address the model by it)",
            ),
        )
    )

    uri: str = Field(
        max_length=2048,
        pattern=MODEL_URI_PATTERN,
        description="Where the weights are: a directory, hf://ORG/NAME, pvc://CLAIM/PATH, "
        "s3://BUCKET/PREFIX or file:///PATH (on the node); or, ending in .gguf, one GGUF file: "
        "hf://ORG/REPO/FILE.gguf, pvc://CLAIM/PATH/FILE.gguf, s3://BUCKET/KEY.gguf or "
        "file:///PATH/FILE.gguf.",
        json_schema_extra=cel(
            (
                f"!self.endsWith('{GGUF_SUFFIX}') || self.matches('{GGUF_URI_PATTERN}')",
                GGUF_URI_MESSAGE,
            )
        ),
    )
    revision: str | None = Field(
        default=None, max_length=128, description="hf:// only: branch, tag or commit to download."
    )
    served_model_name: str | None = Field(
        default=None,
        max_length=253,
        description="Name clients pass as `model`; defaults to metadata.name. Immutable.",
    )
    max_model_len: int | None = Field(
        default=None, ge=16, description="Longest prompt + output per sequence, in tokens."
    )
    credentials_secret: SecretReference | None = Field(
        default=None,
        description="Secret whose keys become environment variables of the download init "
        "container (HF_TOKEN for hf://, AWS_* for s3://).",
    )
    hints: ModelHints | None = Field(
        default=None, description="Architecture numbers for a model not in the built-in catalog."
    )

    @field_validator("uri")
    @classmethod
    def _gguf_names_a_file(cls, uri: str) -> str:
        # The same rule as the CEL one above, for objects stored before it existed.
        if uri.endswith(GGUF_SUFFIX) and not re.match(GGUF_URI_PATTERN, uri):
            raise ValueError(GGUF_URI_MESSAGE)
        return uri

    @property
    def is_gguf(self) -> bool:
        """Whether the URI names one GGUF file (else a directory of weights)."""
        return self.uri.endswith(GGUF_SUFFIX)

    def hf_file(self) -> tuple[str, str]:
        """(ORG/REPO, path of the file in the repository) of an hf:// GGUF URI."""
        org, repo, path = self.uri.removeprefix("hf://").split("/", 2)
        return f"{org}/{repo}", path


class QuantizationSpec(Model):
    weights: WeightQuantization = Field(
        default="none", description="Weight format: none (bf16), int8, fp8, int4-awq, int4-gptq."
    )
    kv_cache: KVCacheQuantization = Field(
        default="auto", description="KV-cache format: auto (model dtype) or fp8."
    )


class ParallelismSpec(Model):
    tensor: int = Field(
        default=1,
        ge=1,
        le=16,
        description="Tensor-parallel size: 1, 2, 4, 8 or 16 GPUs per model shard group.",
        json_schema_extra=cel(
            ("self in [1, 2, 4, 8, 16]", "parallelism.tensor must be one of 1, 2, 4, 8, 16")
        ),
    )
    pipeline: int = Field(default=1, ge=1, le=16, description="Pipeline-parallel stages.")


class ResourcesSpec(Model):
    accelerator: str = Field(
        max_length=63,
        description="Accelerator profile: a built-in name (a100-40gb, a100-80gb, h100-80gb, "
        "h200-141gb, l4, l40s, b200) or an AcceleratorProfile object.",
    )
    cpu: str | None = Field(default=None, max_length=32, description="CPU request and limit.")
    memory: str | None = Field(default=None, max_length=32, description="Memory request and limit.")
    shared_memory: str = Field(default="8Gi", max_length=32, description="Size of /dev/shm.")


class EngineSpec(Model):
    image: str | None = Field(
        default=None, max_length=512, description="Engine image; defaults to the operator's."
    )
    block_size: int = Field(default=16, ge=1, le=256, description="Tokens per KV-cache block.")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of GPU memory the engine may use."
    )
    max_num_seqs: int = Field(default=256, ge=1, description="Sequences batched per step.")
    max_num_batched_tokens: int = Field(default=8192, ge=1, description="Token budget per step.")
    enable_prefix_caching: bool = Field(default=True, description="Reuse cached prompt prefixes.")
    max_queued_requests: int | None = Field(
        default=None, ge=1, description="Requests that may wait; beyond it the engine answers 429."
    )
    max_queued_tokens: int | None = Field(
        default=None, ge=1, description="Prompt tokens that may wait; beyond it, 429."
    )
    extra_args: list[Annotated[str, Field(description="One argument, e.g. --seed or 42.")]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra `kvfleet serve` arguments, appended after the generated ones.",
    )


class SLASpec(Model):
    ttft_ms: int | None = Field(
        default=None,
        ge=1,
        description="Time-to-first-token target (ms): the engine refuses (429) requests it "
        "estimates would miss it.",
    )
    tpot_ms: int | None = Field(
        default=None,
        ge=1,
        description="Time-per-output-token target (ms): the engine caps each step's token "
        "budget to hold it.",
    )
    concurrent_sequences: int = Field(
        default=1,
        ge=1,
        description="Full-length sequences one replica must hold in KV cache at once; sizes the "
        "memory plan.",
    )


class RolloutSpec(Model):
    max_surge: int = Field(default=0, ge=0, description="Extra pods during a rollout.")
    max_unavailable: int = Field(default=1, ge=0, description="Pods that may be down in a rollout.")
    drain_timeout_seconds: int = Field(
        default=30, ge=0, le=3600, description="Time a stopping engine finishes in-flight requests."
    )
    startup_timeout_seconds: int | None = Field(
        default=None,
        ge=30,
        description="Time allowed for loading weights; defaults to 120 s + 10 s per GiB.",
    )


class RoutingSpec(Model):
    """`kvfleet router` in front of the replicas: prefix- and load-aware routing, retries, and
    requests held while the deployment scales up from zero."""

    enabled: bool = Field(
        default=True,
        description="Render the router (Deployment, Service, PDB, RBAC); status.endpoint.url "
        "then points at it. Without it clients reach the engines through their Service.",
    )
    strategy: RoutingStrategy = Field(
        default="prefix",
        description="prefix: the replica holding the longest prefix of the prompt, within a "
        "load bound; least-load: the replica with the fewest requests in flight and queued; "
        "round-robin: each in turn.",
    )
    queue_size: int = Field(
        default=256,
        ge=0,
        le=100000,
        description="Requests the router holds while no replica is available (scaling from "
        "zero, all replicas restarting); beyond it, 503 at once.",
    )
    queue_timeout_seconds: int = Field(
        default=300,
        ge=1,
        le=3600,
        description="Longest a request waits for a replica; then 503 with Retry-After. Cover "
        "a replica's start-up (weights loading) when scaling from zero.",
    )
    scale_to_zero_after_seconds: int = Field(
        default=600,
        ge=30,
        le=86400,
        description="With autoscaling.minReplicas 0: scale to zero after the router saw no "
        "request for this long.",
    )
    image: str | None = Field(
        default=None,
        max_length=512,
        description="Router image; defaults to the operator's (it carries `kvfleet router`).",
    )


def _one_rate_target(name: str) -> tuple[str, str]:
    rate = f"self.autoscaling.targets.{name}"
    return (
        f"!has(self.autoscaling) || !has({rate}) || "
        f"has({rate}.tokensPerSecond) != has({rate}.capacityFraction)",
        f"autoscaling.targets.{name}: set exactly one of tokensPerSecond or capacityFraction",
    )


# CEL mirrors of AutoscalingSpec's own validators, so kubectl rejects what the operator would.
_AUTOSCALING_RULES = (
    (
        "!has(self.autoscaling) || has(self.autoscaling.targets.generationTokenRate) || "
        "has(self.autoscaling.targets.promptTokenRate) || "
        "has(self.autoscaling.targets.kvCacheUtilization) || "
        "has(self.autoscaling.targets.waitingRequestsPerReplica) || "
        "has(self.autoscaling.targets.ttft) || has(self.autoscaling.targets.tpot)",
        "autoscaling.targets: set at least one of generationTokenRate, promptTokenRate, "
        "kvCacheUtilization, waitingRequestsPerReplica, ttft, tpot",
    ),
    (
        "!has(self.autoscaling) || !has(self.autoscaling.behavior) || "
        "self.autoscaling.behavior.panicWindowSeconds <= "
        "self.autoscaling.behavior.stableWindowSeconds",
        "autoscaling.behavior.panicWindowSeconds must be <= stableWindowSeconds",
    ),
    _one_rate_target("generationTokenRate"),
    (
        "!has(self.autoscaling) || !has(self.autoscaling.targets.promptTokenRate) || "
        "(has(self.autoscaling.targets.promptTokenRate.tokensPerSecond) && "
        "!has(self.autoscaling.targets.promptTokenRate.capacityFraction))",
        "autoscaling.targets.promptTokenRate: set tokensPerSecond (capacityFraction is not "
        "supported: the engine measures generation capacity only)",
    ),
)


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
            *_AUTOSCALING_RULES,
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
        default=None, ge=0, description="Fixed replica count (exclusive with autoscaling)."
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

    def effective_replicas(self) -> int | None:
        """Replicas the reconciler writes; None when the autoscaler owns them."""
        if self.suspend:
            return 0
        if self.autoscaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas


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


class Condition(Model):
    """One condition (Ready, Progressing, Degraded, Stalled, ScalingLimited)."""

    type: str = Field(description="Ready, Progressing, Degraded, Stalled or ScalingLimited.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="One CamelCase word, e.g. Available or InsufficientMemory.")
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
