"""What the cluster reports about an InferenceDeployment's children, summarized, pure: the
workload's replicas and rollout, the pods stuck failing or unschedulable, the weight format its
engine pods run, and why a Deployment cannot run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet_operator.render_pod import rendered_weights

# Container waiting reasons that mean the pod will not serve without a change.
FAILING_WAIT_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)
# Those whose kubelet message says what to fix (`secret "my-api-key" not found`, the image that
# cannot be pulled); CrashLoopBackOff's only says it backs off, the container's log says why.
EXPLAINED_WAIT_REASONS = FAILING_WAIT_REASONS - {"CrashLoopBackOff"}
MAX_WAIT_MESSAGE = 200  # characters of a kubelet message kept, on one line


@dataclass(frozen=True)
class WorkloadState:
    """The child workload and its pods, summarized; a replica is a pod of the Deployment, or a
    group of pods (LeaderWorkerSet, StatefulSet groups: topology_groups.py)."""

    desired: int  # replicas wanted (the autoscaler's number when it owns it)
    replicas: int  # replicas of any revision
    updated: int  # replicas of the current template
    ready: int  # replicas passing readiness (a group: its leader, ready once all ranks are)
    current: bool  # the workload's controller has seen the latest template
    deadline_exceeded: bool  # Progressing=False, ProgressDeadlineExceeded
    failing_pods: tuple[str, ...]  # "pod: reason[: kubelet message]", pods stuck failing
    unschedulable: str | None  # the scheduler's message for a pending pod, if any
    quantization: str  # quantization.weights of the Deployment's engine container
    # The Deployment's ReplicaFailure message: the API server or an admission webhook refuses
    # its pods (a PodSecurity level, a quota), so no pod exists to report anything.
    pods_refused: str | None = None
    # Why the router's Deployment cannot run (its pods refused, its rollout past its deadline):
    # status.endpoint.url points at the router, so nothing reaches the engines meanwhile.
    router_failure: str | None = None
    # ScalingLimited as an HPA or a KEDA ScaledObject reports it (controller HPA / KEDA, where
    # the operator's own autoscaler, which writes it otherwise, does not run).
    external_scaling: tuple[str, str, str] | None = None


def external_scaling(autoscaler: dict[str, Any]) -> tuple[str, str, str] | None:
    """(status, reason, message) of ScalingLimited from the conditions of the HPA or ScaledObject
    the operator rendered: True, with its own reason and message, while it cannot read its
    metrics or scale, or holds the replicas at a bound; None before it reports anything."""
    kind, name = autoscaler.get("kind", ""), autoscaler["metadata"]["name"]
    conditions = autoscaler.get("status", {}).get("conditions") or []
    if not conditions:
        return None
    broken = ("AbleToScale", "ScalingActive", "Ready")  # False: it does not scale
    for condition in conditions:
        limited = condition.get("type") == "ScalingLimited" and condition.get("status") == "True"
        fallback = condition.get("type") == "Fallback" and condition.get("status") == "True"
        if (condition.get("type") in broken and condition.get("status") == "False") or (
            limited or fallback
        ):
            reason = condition.get("reason") or condition.get("type", "")
            message = condition.get("message") or reason
            return ("True", reason, f"{kind} {name}: {message}")
    return ("False", "ScalingActive", f"{kind} {name} reads its metrics and scales")


def summarize_workload(deployment: dict[str, Any], pods: list[dict[str, Any]]) -> WorkloadState:
    spec, status = deployment.get("spec", {}), deployment.get("status", {})
    failing, unschedulable = pod_troubles(pods)
    return WorkloadState(
        desired=spec.get("replicas", 1),
        replicas=status.get("replicas", 0),
        updated=status.get("updatedReplicas", 0),
        ready=status.get("readyReplicas", 0),
        current=status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0),
        deadline_exceeded=_past_deadline(status) is not None,
        failing_pods=failing,
        unschedulable=unschedulable,
        quantization=engine_weights(spec.get("template", {})),
        pods_refused=_replica_failure(status),
    )


def _replica_failure(status: dict[str, Any]) -> str | None:
    """A Deployment's ReplicaFailure message (the API server or a webhook refuses its pods)."""
    refused = find_condition(status.get("conditions", []), "ReplicaFailure")
    if refused is None or refused.get("status") != "True":
        return None
    return str(refused.get("message") or refused.get("reason") or "ReplicaFailure")


def deployment_failure(deployment: dict[str, Any]) -> str | None:
    """Why a Deployment cannot run: its pods refused, or its rollout past its deadline."""
    status = deployment.get("status", {})
    return _replica_failure(status) or _past_deadline(status)


def _past_deadline(status: dict[str, Any]) -> str | None:
    """A Deployment's ProgressDeadlineExceeded message (its rollout stopped progressing)."""
    progressing = find_condition(status.get("conditions", []), "Progressing")
    if progressing is None or progressing.get("reason") != "ProgressDeadlineExceeded":
        return None
    return str(progressing.get("message") or "its rollout exceeded its progress deadline")


def pod_troubles(pods: list[dict[str, Any]]) -> tuple[tuple[str, ...], str | None]:
    """("pod: reason[: kubelet message]" for each pod stuck in a failing state, sorted; the
    scheduler's message for an unschedulable pod, if any), over the pods not terminating."""
    failing, unschedulable = [], None
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        pod_status = pod.get("status", {})
        statuses = pod_status.get("initContainerStatuses", []) + pod_status.get(
            "containerStatuses", []
        )
        for container in statuses:
            waiting = container.get("state", {}).get("waiting") or {}
            if waiting.get("reason") in FAILING_WAIT_REASONS:
                failing.append(f"{pod['metadata']['name']}: {_waiting_trouble(waiting)}")
                break
        scheduled = find_condition(pod_status.get("conditions", []), "PodScheduled")
        if scheduled and scheduled.get("reason") == "Unschedulable":
            unschedulable = scheduled.get("message", "Unschedulable")
    return tuple(sorted(failing)), unschedulable


def _waiting_trouble(waiting: dict[str, Any]) -> str:
    """A container's waiting reason, with the kubelet's message where it says what to fix."""
    reason = str(waiting["reason"])
    message = " ".join(str(waiting.get("message") or "").split())
    if reason not in EXPLAINED_WAIT_REASONS or not message:
        return reason
    if len(message) > MAX_WAIT_MESSAGE:
        message = message[: MAX_WAIT_MESSAGE - 1] + "…"
    return f"{reason}: {message}"


def engine_weights(template: dict[str, Any]) -> str:
    """quantization.weights of the engine container of a pod template."""
    containers = template.get("spec", {}).get("containers", [])
    engine: dict[str, Any] = next((c for c in containers if c.get("name") == "engine"), {})
    return rendered_weights(list(engine.get("args", [])))


def find_condition(conditions: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)
