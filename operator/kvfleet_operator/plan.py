"""Planning, pure: from a spec, its accelerator profile and what the cluster offers, decide the
topology of one replica, estimate its memory and list every reason it cannot run.

Memory per GPU, all in bytes (documented in the README):
  weights  = bytes of the weights in the engine's layout (kvfleet_engine/quant/layout.py)
             / (tensor × pipeline). none: 2 per parameter (bf16). Quantized: each linear layer
             of a block (q, k, v, o, gate, up, down; in × out) holds codes (int8/fp8 1 byte,
             int4 0.5) plus scale bytes: int8 and fp8 one float32 per output column, int4 an
             fp16 scale and an fp16 offset per 128 input columns of each output column
             (0.5 + 4/128 = 0.53125 per weight); the rest of the parameters (embeddings, lm
             head, norms, biases) stays 2 bytes. Without the MLP width (hints without
             intermediateSize) every parameter counts as a linear weight of hidden-size inputs.
             For numbers from a GGUF header, each tensor at the engine's bytes instead
             (engine_features.GGUF_KEPT_QUANTIZED): block linears of Q8_0 1.0625 per weight,
             Q4_0 / Q4_1 / Q4_K 0.625; a fused q/k/v or gate/up of mixed kinds, and every other
             tensor, 2 (about 1.03 per parameter for an 8B Q4_K_M file, which holds about 0.6)
  kv cache = 2 (K and V) × ceil(layers / pipeline) × ceil(kv heads / tensor)
             × (head dim × bytes per KV element (auto 2, fp8 1) + scale bytes (fp8: one
             bfloat16 per token and KV head, else 0)) × maxModelLen × sla.concurrentSequences
  overhead = RUNTIME_RESERVE_GIB (CUDA context, activations, sampler buffers)
  fits when weights + kv cache + overhead <= device memory × engine.gpuMemoryUtilization
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvfleet_operator import engine_features
from kvfleet_operator.engine_features import unavailable_features
from kvfleet_operator.gguf_header import GGUFTensor
from kvfleet_operator.model_catalog import ModelArchitecture, UnknownModel
from kvfleet_operator.models import (
    AcceleratorProfileSpec,
    InferenceDeploymentSpec,
    MemoryPlan,
    ModelHints,
    Topology,
    WeightQuantization,
)
from kvfleet_operator.plan_checks import (
    Problem,
    check_autoscaling,
    check_child_names,
    check_context,
    check_group_count,
    check_host_path,
    check_parallelism,
    check_quantization,
)
from kvfleet_operator.topology import plan_topology

GIB = 1024**3
RUNTIME_RESERVE_GIB = 1.5
UNQUANTIZED_BYTES = 2  # bf16: every weight of `none`, and what a quantized model keeps unquantized
KV_ELEMENT_BYTES = {"auto": 2, "fp8": 1, "int8": 1}
# A quantized KV cache (e4m3 or int8 codes) keeps one bfloat16 scale per (token, KV head) beside
# the blocks, for K and V (engine kernels/kv_fp8.py).
KV_SCALE_BYTES = {"auto": 0, "fp8": 2, "int8": 2}
INT4_GROUP_SIZE = 128  # input columns per int4 scale and offset (AWQ's and GPTQ's usual group)
# Startup probe budget: loading reads weights from local disk or a volume.
STARTUP_BASE_SECONDS = 120
STARTUP_SECONDS_PER_GIB = 10
STARTUP_UNKNOWN_MODEL_SECONDS = 900


@dataclass(frozen=True)
class WeightFormat:
    """How the engine stores a quantized linear layer's weights (kvfleet_engine/quant/layout.py)."""

    code_bytes: float  # bytes per weight
    scale_bytes: int  # bytes per (group of input columns, output column): scale and offset
    group_size: int | None  # input columns per scale; None: one scale per output column


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "int8": WeightFormat(code_bytes=1, scale_bytes=4, group_size=None),  # float32 scales [1, N]
    "fp8": WeightFormat(code_bytes=1, scale_bytes=4, group_size=None),  # float32 scale [N]
    # fp16 scales and fp16 offsets, each [K // group, N]
    "int4-awq": WeightFormat(code_bytes=0.5, scale_bytes=2 + 2, group_size=INT4_GROUP_SIZE),
    "int4-gptq": WeightFormat(code_bytes=0.5, scale_bytes=2 + 2, group_size=INT4_GROUP_SIZE),
}


@dataclass(frozen=True)
class ClusterFeatures:
    """Optional APIs found in the cluster."""

    leader_worker_set: bool  # the API serves leaderworkerset.x-k8s.io/v1 LeaderWorkerSets
    service_monitor: bool  # servicemonitors.monitoring.coreos.com is installed
    keda: bool = False  # scaledobjects.keda.sh is installed (autoscaling.controller: KEDA)


@dataclass(frozen=True)
class Plan:
    served_model_name: str  # what clients pass as `model`
    topology: Topology | None  # None when the accelerator is unknown
    memory: MemoryPlan | None  # None when the model architecture is unknown
    startup_timeout_seconds: int  # startup probe budget for loading weights
    problems: tuple[Problem, ...]  # empty when the plan can be rolled out
    memory_unknown_reason: str | None = None  # why memory is None (an unknown model)

    @property
    def ok(self) -> bool:
        return not self.problems


def plan_deployment(
    name: str,
    spec: InferenceDeploymentSpec,
    profile: AcceleratorProfileSpec | None,
    model: ModelArchitecture | UnknownModel,
    cluster: ClusterFeatures,
    *,
    host_path_prefixes: tuple[str, ...] | None = None,
    invalid_profile: str | None = None,
) -> Plan:
    """What to run for `spec`, or the problems that stop it. `host_path_prefixes`: the node
    directories a file:// model may be under (`kvfleet operator --host-path-prefix`; None: any);
    `invalid_profile`: why the AcceleratorProfile of that name was left out, if it was."""
    served_model_name = spec.model.served_model_name or name
    if profile is None:
        accelerator = spec.resources.accelerator
        problem = Problem(
            "UnknownAccelerator",
            f"resources.accelerator={accelerator!r} is neither built in nor an "
            "AcceleratorProfile in the cluster"
            if invalid_profile is None
            else f"resources.accelerator={accelerator!r}: the AcceleratorProfile of that name "
            f"is invalid ({invalid_profile}); fix it and this deployment is planned again",
        )
        return Plan(served_model_name, None, None, STARTUP_UNKNOWN_MODEL_SECONDS, (problem,))

    topology, layout_error = plan_topology(
        spec, profile, leader_worker_set=cluster.leader_worker_set
    )
    known = model if isinstance(model, ModelArchitecture) else None
    memory = plan_memory(spec, profile, known) if known is not None else None
    problems = [
        *check_parallelism(spec, known.numbers if known is not None else None),
        *([Problem("InvalidParallelism", layout_error.message)] if layout_error else []),
        *check_quantization(spec, profile),
    ]
    if known is not None:  # before the memory's: a context the model refuses also fills it
        problems += check_context(spec, known.numbers)
    if memory is not None and not memory.fits:
        problems.append(Problem("InsufficientGPUMemory", _memory_message(spec, profile, memory)))
    problems += check_host_path(spec, host_path_prefixes)
    external = spec.autoscaling.controller if spec.autoscaling is not None else "Builtin"
    if topology.kind == "StatefulSet" and external != "Builtin":
        problems.append(
            Problem(
                "GroupAutoscalingUnavailable",
                f"autoscaling.controller={external} scales the replicas of one object, but a "
                f"replica of {topology.pods_per_replica} nodes runs as one StatefulSet per "
                "replica (the LeaderWorkerSet CRD is not installed): use controller Builtin, "
                "or install LeaderWorkerSet",
            )
        )
    if spec.autoscaling is not None and spec.autoscaling.controller == "KEDA" and not cluster.keda:
        problems.append(
            Problem(
                "KedaUnavailable",
                "autoscaling.controller=KEDA needs the KEDA CRDs (scaledobjects.keda.sh), which "
                "are not installed; install KEDA or use controller Builtin",
            )
        )
    problems += check_autoscaling(spec)
    problems += check_child_names(name, spec, topology.kind)
    problems += check_group_count(spec, topology.kind)
    problems += [Problem("FeatureUnavailable", m) for m in unavailable_features(spec)]
    return Plan(
        served_model_name=served_model_name,
        topology=topology,
        memory=memory,
        startup_timeout_seconds=_startup_timeout(spec, memory, topology),
        problems=tuple(problems),
        memory_unknown_reason=model.reason if isinstance(model, UnknownModel) else None,
    )


def plan_memory(
    spec: InferenceDeploymentSpec, profile: AcceleratorProfileSpec, architecture: ModelArchitecture
) -> MemoryPlan:
    tp, pp = spec.parallelism.tensor, spec.parallelism.pipeline
    model = architecture.numbers
    weights = _weight_bytes(spec, architecture) / (tp * pp)
    kv_cache = spec.quantization.kv_cache
    kv_per_token = (
        2
        * math.ceil(model.num_layers / pp)
        * math.ceil(model.num_key_value_heads / tp)
        * (model.head_dim * KV_ELEMENT_BYTES[kv_cache] + KV_SCALE_BYTES[kv_cache])
    )
    max_len = spec.model.max_model_len or model.max_position_embeddings or 0
    kv = kv_per_token * max_len * spec.sla.concurrent_sequences
    required = weights / GIB + kv / GIB + RUNTIME_RESERVE_GIB
    available = profile.memory_gib * spec.engine.gpu_memory_utilization
    return MemoryPlan(
        source=architecture.source,
        weights_gib=round(weights / GIB, 2),
        kv_cache_gib=round(kv / GIB, 2),
        overhead_gib=RUNTIME_RESERVE_GIB,
        required_gib=round(required, 2),
        available_gib=round(available, 2),
        fits=required <= available,
    )


def _weight_bytes(spec: InferenceDeploymentSpec, architecture: ModelArchitecture) -> float:
    """Bytes of the weights in GPU memory, all GPUs together."""
    if architecture.gguf_tensors and engine_features.GGUF_WEIGHTS_STAY_QUANTIZED:
        return gguf_weight_bytes(architecture.gguf_tensors)
    return weight_bytes(architecture.numbers, spec.quantization.weights)


# GGUF block linears (blk.N.<part>.weight) -> the engine layer holding them; the parts of a
# fused layer (q/k/v, gate/up) stay quantized only when all have one kind.
_GGUF_LAYERS = {
    "attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_output": "o",
    "ffn_gate": "gate_up", "ffn_up": "gate_up", "ffn_down": "down",
}  # fmt: skip
_GGUF_LINEAR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def gguf_weight_bytes(tensors: tuple[GGUFTensor, ...]) -> float:
    """Bytes of a GGUF file's weights once the engine has loaded them on a GPU."""
    layers: dict[tuple[str, str], list[GGUFTensor]] = {}  # (block, engine layer) -> its parts
    total = 0.0
    for tensor in tensors:
        match = _GGUF_LINEAR.fullmatch(tensor.name)
        if match is not None and match[2] in _GGUF_LAYERS:
            layers.setdefault((match[1], _GGUF_LAYERS[match[2]]), []).append(tensor)
        else:
            total += tensor.elements * UNQUANTIZED_BYTES
    for parts in layers.values():
        kept = [engine_features.GGUF_KEPT_QUANTIZED.get(t.type_name) for t in parts]
        kinds = {k[0] if k is not None else None for k in kept}
        for tensor, kind_bytes in zip(parts, kept, strict=True):
            per_weight: float = UNQUANTIZED_BYTES
            if kind_bytes is not None and len(kinds) == 1:
                per_weight = kind_bytes[1]
            total += tensor.elements * per_weight
    return total


def weight_bytes(model: ModelHints, weights: WeightQuantization) -> float:
    """Bytes of a model's weights in `weights` format, all GPUs together."""
    fmt = WEIGHT_FORMATS.get(weights)
    if fmt is None:
        return model.num_parameters * UNQUANTIZED_BYTES
    shapes = _block_linears(model)
    linear = model.num_layers * sum(k * n for k, n in shapes)
    if not shapes or linear > model.num_parameters:  # no MLP width, or hints that disagree
        return model.num_parameters * (
            fmt.code_bytes + fmt.scale_bytes / (fmt.group_size or model.hidden)
        )
    quantized = model.num_layers * sum(_linear_bytes(fmt, k, n) for k, n in shapes)
    return quantized + (model.num_parameters - linear) * UNQUANTIZED_BYTES


def _block_linears(model: ModelHints) -> list[tuple[int, int]]:
    """(in, out) features of the linear layers of one block: q, k, v, o, gate, up, down; empty
    without the MLP width."""
    if model.intermediate_size is None:
        return []
    hidden, ffn = model.hidden, model.intermediate_size
    q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, ffn), (hidden, ffn),
            (ffn, hidden)]  # fmt: skip


def _linear_bytes(fmt: WeightFormat, in_features: int, out_features: int) -> float:
    groups = 1 if fmt.group_size is None else math.ceil(in_features / fmt.group_size)
    return in_features * out_features * fmt.code_bytes + groups * out_features * fmt.scale_bytes


def _memory_message(
    spec: InferenceDeploymentSpec, profile: AcceleratorProfileSpec, memory: MemoryPlan
) -> str:
    return (
        f"needs {memory.required_gib} GiB per GPU (weights {memory.weights_gib} + KV cache "
        f"{memory.kv_cache_gib} + overhead {memory.overhead_gib}) but "
        f"{spec.resources.accelerator} offers {memory.available_gib} GiB "
        f"({profile.memory_gib:g} GiB × gpuMemoryUtilization "
        f"{spec.engine.gpu_memory_utilization:g}); raise parallelism.tensor, quantize the "
        "weights, or lower model.maxModelLen / sla.concurrentSequences"
    )


def _startup_timeout(
    spec: InferenceDeploymentSpec, memory: MemoryPlan | None, topology: Topology
) -> int:
    if spec.rollout.startup_timeout_seconds is not None:
        return spec.rollout.startup_timeout_seconds
    if memory is None:
        return STARTUP_UNKNOWN_MODEL_SECONDS
    weights_per_pod = memory.weights_gib * topology.gpus_per_pod
    return STARTUP_BASE_SECONDS + math.ceil(STARTUP_SECONDS_PER_GIB * weights_per_pod)
