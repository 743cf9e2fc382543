"""Planning's checks, pure: each reads the spec (and what is known of the model and the GPU) and
returns the reasons it cannot run as written, every message naming the field and the numbers.
The CRD's schema and CEL rules refuse what one field or one object can tell; these need the
model's numbers, the accelerator profile or the operator's own settings."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_operator.accelerators import PRODUCT_LABEL
from kvfleet_operator.autoscaling.spec import AutoscalingBehavior
from kvfleet_operator.models import AcceleratorProfileSpec, InferenceDeploymentSpec, ModelHints
from kvfleet_operator.topology import statefulset_name
from kvfleet_operator.wire import to_wire_name

FP8_MIN_COMPUTE_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Problem:
    """One reason the deployment cannot run as specified."""

    reason: str  # CamelCase, used as the Stalled condition's reason
    message: str  # names the field and the numbers


# A StatefulSet's pods carry a controller-revision-hash label: its name, a dash and a hash of up
# to 10 characters. Label values stop at 63 characters, so a longer StatefulSet name cannot
# create pods (kubernetes/kubernetes#64023).
STATEFULSET_NAME_MAX = 52
# Replicas of several nodes without LeaderWorkerSet: one StatefulSet each, all rendered and
# applied on every pass, so their number is bounded (50,000 took 9 s and 768 MiB to render,
# past the operator pod's memory limit: every deployment in the cluster went unmanaged).
STATEFULSET_GROUPS_MAX = 512


def _most_replicas(spec: InferenceDeploymentSpec) -> int:
    return spec.autoscaling.max_replicas if spec.autoscaling is not None else spec.replicas or 1


def check_group_count(spec: InferenceDeploymentSpec, kind: str) -> list[Problem]:
    """Replicas of several nodes as StatefulSets: at most STATEFULSET_GROUPS_MAX of them."""
    most = _most_replicas(spec)
    if kind != "StatefulSet" or most <= STATEFULSET_GROUPS_MAX:
        return []
    field = "autoscaling.maxReplicas" if spec.autoscaling is not None else "replicas"
    return [
        Problem(
            "TooManyReplicas",
            f"{field}={most}: replicas of several nodes run as one StatefulSet each without "
            f"LeaderWorkerSet, at most {STATEFULSET_GROUPS_MAX}; lower {field} or install "
            "LeaderWorkerSet (one object for every replica)",
        )
    ]


def check_child_names(name: str, spec: InferenceDeploymentSpec, kind: str) -> list[Problem]:
    """A replica of several nodes runs as StatefulSets named after the deployment and the
    replica's index (one per replica, or a LeaderWorkerSet's worker sets): the longest of them,
    at the most replicas the spec allows, must stay within STATEFULSET_NAME_MAX."""
    if kind not in ("StatefulSet", "LeaderWorkerSet"):
        return []
    longest = statefulset_name(name, max(_most_replicas(spec) - 1, 0))
    if len(longest) <= STATEFULSET_NAME_MAX:
        return []
    room = STATEFULSET_NAME_MAX - (len(longest) - len(name))
    return [
        Problem(
            "NameTooLong",
            f"metadata.name {name!r} ({len(name)} characters) is too long for replicas of several "
            f"nodes: their StatefulSets ({longest!r}, {len(longest)} characters) must stay within "
            f"{STATEFULSET_NAME_MAX}, or their pods cannot be created; use a name of at most "
            f"{room} characters",
        )
    ]


def check_host_path(
    spec: InferenceDeploymentSpec, prefixes: tuple[str, ...] | None
) -> list[Problem]:
    """A file:// model is a hostPath volume of the node: whoever may create an
    InferenceDeployment would read any node directory through it. With `prefixes` set, only
    paths under them are mounted (the CRD already refuses `..` segments and relative paths)."""
    uri = spec.model.uri
    if prefixes is None or not uri.startswith("file://"):
        return []
    path = uri.removeprefix("file://")
    if any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes):
        return []
    allowed = ", ".join(prefixes) if prefixes else "none"
    return [
        Problem(
            "HostPathNotAllowed",
            f"model.uri={uri}: this operator mounts node directories under {allowed} only "
            "(kvfleet operator --host-path-prefix); use pvc://, hf:// or s3://",
        )
    ]


def check_context(spec: InferenceDeploymentSpec, model: ModelHints) -> list[Problem]:
    """model.maxModelLen beyond the model's positions: the engine refuses it at start-up (the
    pods would crash-loop), so nothing is rolled out."""
    wanted, positions = spec.model.max_model_len, model.max_position_embeddings
    if wanted is None or positions is None or wanted <= positions:
        return []
    return [
        Problem(
            "ContextTooLong",
            f"model.maxModelLen={wanted} exceeds the model's {positions} positions "
            "(max_position_embeddings), which the engine refuses; set at most "
            f"{positions} or leave it unset",
        )
    ]


def check_parallelism(spec: InferenceDeploymentSpec, model: ModelHints | None) -> list[Problem]:
    if model is None:
        return []
    tp, pp = spec.parallelism.tensor, spec.parallelism.pipeline
    problems = []
    if model.num_attention_heads % tp:
        problems.append(
            Problem(
                "InvalidParallelism",
                f"parallelism.tensor={tp} does not divide the model's "
                f"{model.num_attention_heads} attention heads",
            )
        )
    elif model.num_key_value_heads % tp and tp % model.num_key_value_heads:
        problems.append(
            Problem(
                "InvalidParallelism",
                f"parallelism.tensor={tp} and the model's {model.num_key_value_heads} KV heads: "
                "one must divide the other",
            )
        )
    if model.intermediate_size is not None and model.intermediate_size % tp:
        problems.append(
            Problem(
                "InvalidParallelism",
                f"parallelism.tensor={tp} does not divide the model's MLP width "
                f"(intermediateSize {model.intermediate_size}), which the engine splits evenly "
                "over the ranks",
            )
        )
    if pp > model.num_layers:
        problems.append(
            Problem(
                "InvalidParallelism",
                f"parallelism.pipeline={pp} exceeds the model's {model.num_layers} layers",
            )
        )
    return problems


def check_quantization(
    spec: InferenceDeploymentSpec, profile: AcceleratorProfileSpec
) -> list[Problem]:
    major, minor = (int(p) for p in profile.compute_capability.split("."))
    if (major, minor) >= FP8_MIN_COMPUTE_CAPABILITY:
        return []
    fp8_fields = [
        f"quantization.{field}=fp8"
        for field, value in (
            ("weights", spec.quantization.weights),
            ("kvCache", spec.quantization.kv_cache),
        )
        if value == "fp8"
    ]
    need = ".".join(str(p) for p in FP8_MIN_COMPUTE_CAPABILITY)
    gpu = spec.resources.accelerator
    if PRODUCT_LABEL in profile.node_selector:
        gpu += f" ({profile.node_selector[PRODUCT_LABEL]})"
    hint = {"quantization.kvCache=fp8": " (quantization.kvCache=int8 runs on any GPU)"}
    return [
        Problem(
            "UnsupportedQuantization",
            f"{field} needs compute capability >= {need}; {gpu} has {profile.compute_capability}"
            + hint.get(field, ""),
        )
        for field in fp8_fields
    ]


# autoscaling.behavior's fields that only the built-in autoscaler reads, and those an HPA or a
# KEDA ScaledObject also carries (actuators.hpa_behavior: the scale-up and scale-down rules;
# KEDA: syncPeriodSeconds as its polling interval, stableWindowSeconds as its queries' window).
_BUILTIN_ONLY = ("panic_window_seconds", "panic_threshold", "tolerance", "warmup_seconds")
_BUILTIN_AND_KEDA = ("sync_period_seconds", "stable_window_seconds")


def check_autoscaling(spec: InferenceDeploymentSpec) -> list[Problem]:
    """What the CRD's rules cannot see: scaling from zero needs the router to hold requests, and
    a behavior field set for a controller that would ignore it."""
    autoscaling = spec.autoscaling
    if autoscaling is None:
        return []
    problems = []
    if autoscaling.min_replicas == 0 and not spec.routing.enabled:
        problems.append(
            "autoscaling.minReplicas: 0 needs routing.enabled: true (the router holds requests "
            "while a replica starts and tells the autoscaler they wait)"
        )
    elif autoscaling.min_replicas == 0 and spec.routing.queue_size == 0:
        problems.append(
            "autoscaling.minReplicas: 0 needs routing.queueSize >= 1: at zero replicas the "
            "router answers 503 at once instead of holding the request, so no request ever "
            "waits and nothing scales the deployment back up"
        )
    controller = autoscaling.controller
    if controller != "Builtin":
        ignored = _BUILTIN_ONLY + (_BUILTIN_AND_KEDA if controller == "HPA" else ())
        behavior, default = autoscaling.behavior, AutoscalingBehavior()
        fields = [
            f"behavior.{to_wire_name(field)}"
            for field in ignored
            if getattr(behavior, field) != getattr(default, field)
        ]
        if behavior.scale_down.drain_timeout_seconds != default.scale_down.drain_timeout_seconds:
            fields.append("behavior.scaleDown.drainTimeoutSeconds")
        problems += [
            f"autoscaling.{field} is read by controller Builtin only; controller {controller} "
            "has no such setting (remove it, or use controller Builtin)"
            for field in fields
        ]
    return [Problem("InvalidAutoscaling", message) for message in problems]
