"""Status, pure: the summarized workload (workload_state.py) and the plan, turned into the
InferenceDeployment's status (kstatus conditions Ready / Reconciling / Stalled plus Planned and
Available) and the events that explain each transition."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet_operator.models import InferenceDeploymentSpec
from kvfleet_operator.plan import Plan
from kvfleet_operator.render import endpoint_url, selector_string
from kvfleet_operator.render_router import router_url
from kvfleet_operator.workload_state import WorkloadState, find_condition

OWN_CONDITIONS = ("Ready", "Reconciling", "Stalled", "Planned", "Available")
# The autoscaler's condition: it writes it; the reconciler removes it with spec.autoscaling.
SCALING_LIMITED = "ScalingLimited"
MAX_FAILING_PODS_SHOWN = 3  # failing pods the Stalled message names; the others are counted


def compute_status(
    *,
    name: str,
    namespace: str,
    generation: int,
    spec: InferenceDeploymentSpec,
    plan: Plan,
    workload: WorkloadState | None,
    old_status: dict[str, Any],
    now: str,
) -> dict[str, Any]:
    """The status fields the reconciler owns (camelCase), ready for a merge patch."""
    conditions = _conditions(spec, plan, workload)
    desired = _desired(spec, workload)
    ready = workload.ready if workload else 0
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": _merge_conditions(
            old_status.get("conditions", []), conditions, generation, now
        ),
        "replicas": workload.replicas if workload else 0,
        "readyReplicas": ready,
        "updatedReplicas": workload.updated if workload else 0,
        "replicasSummary": f"{ready}/{desired}",
        "scaling": _scaling(spec),
        "quantization": _quantization(spec, plan, workload),
        "selector": selector_string(name),
        "endpoint": {
            "url": router_url(name, namespace)
            if spec.routing.enabled
            else endpoint_url(name, namespace),
            "servedModelName": plan.served_model_name,
        },
        "topology": plan.topology.model_dump(by_alias=True) if plan.topology else None,
        "memoryPlan": plan.memory.model_dump(by_alias=True) if plan.memory else None,
    }
    external = workload.external_scaling if workload is not None else None
    if external is not None and spec.autoscaling is not None:  # an HPA's or ScaledObject's word
        status["conditions"] = _merge_condition(
            status["conditions"], SCALING_LIMITED, external, now
        )
    if spec.autoscaling is None:
        # What the autoscaler wrote goes with it: status.autoscaling (whose desiredReplicas
        # would otherwise size StatefulSet groups again when autoscaling comes back) and its
        # ScalingLimited condition.
        status["autoscaling"] = None
        status["conditions"] = [c for c in status["conditions"] if c.get("type") != SCALING_LIMITED]
    return status


def _quantization(
    spec: InferenceDeploymentSpec, plan: Plan, workload: WorkloadState | None
) -> str | None:
    """The weight format the engine pods run: the Deployment's, which a stalled spec change does
    not touch; the spec's while its first Deployment is created; None when nothing runs."""
    if workload is not None:
        return workload.quantization
    return spec.quantization.weights if plan.ok else None


def _desired(spec: InferenceDeploymentSpec, workload: WorkloadState | None) -> int:
    replicas = spec.effective_replicas()
    if replicas is not None:
        return replicas
    if workload is not None:
        return workload.desired
    assert spec.autoscaling is not None
    return spec.autoscaling.min_replicas


def _scaling(spec: InferenceDeploymentSpec) -> str:
    if spec.suspend:
        return "Suspended"
    if spec.autoscaling is not None:
        return f"Auto({spec.autoscaling.min_replicas}-{spec.autoscaling.max_replicas})"
    return "Manual"


ConditionFields = tuple[str, str, str]  # status, reason, message
_GROUP_WORKLOAD = {"LeaderWorkerSet": "a LeaderWorkerSet", "StatefulSet": "one StatefulSet each"}


def _conditions(
    spec: InferenceDeploymentSpec, plan: Plan, workload: WorkloadState | None
) -> dict[str, ConditionFields]:
    conditions: dict[str, ConditionFields] = {}
    if plan.problems:
        reason = plan.problems[0].reason
        message = "; ".join(p.message for p in plan.problems)
        conditions["Planned"] = ("False", reason, message)
        conditions["Stalled"] = ("True", reason, message)
        conditions["Reconciling"] = ("False", "Stalled", "waiting for a spec that can run")
        conditions["Ready"] = ("False", reason, message)
    else:
        conditions["Planned"] = ("True", "Planned", _plan_summary(spec, plan))
        assert plan.topology is not None
        conditions.update(_rollout_conditions(spec, workload, plan.topology.kind))
    conditions["Available"] = _available(spec, workload)
    return conditions


def _rollout_conditions(
    spec: InferenceDeploymentSpec, workload: WorkloadState | None, kind: str
) -> dict[str, ConditionFields]:
    if workload is None:
        message = f"creating the {kind}"
        return {
            "Stalled": ("False", "Progressing", message),
            "Reconciling": ("True", "Creating", message),
            "Ready": ("False", "Creating", message),
        }
    desired = _desired(spec, workload)
    if workload.failing_pods:
        message = f"pods are not starting: {_first_failing(workload.failing_pods)}"
        reason = "EngineFailing"
        return {
            "Stalled": ("True", reason, message),
            "Reconciling": ("False", reason, message),
            "Ready": ("False", reason, message),
        }
    if spec.routing.enabled and workload.router_failure:
        message = (
            f"the router cannot run ({workload.router_failure}); status.endpoint.url points at "
            "it, so no request reaches the engines"
        )
        return {
            "Stalled": ("True", "RouterFailing", message),
            "Reconciling": ("False", "RouterFailing", message),
            "Ready": ("False", "RouterFailing", message),
        }
    if workload.deadline_exceeded:
        message = "the rollout exceeded its progress deadline"
        return {
            "Stalled": ("True", "ProgressDeadlineExceeded", message),
            "Reconciling": ("False", "ProgressDeadlineExceeded", message),
            "Ready": ("False", "ProgressDeadlineExceeded", message),
        }
    done = (
        workload.current
        and workload.updated >= desired
        and workload.ready >= desired
        and workload.replicas == desired
    )
    if done:
        reason = "AllReplicasReady"
        if desired == 0:
            reason = "Suspended" if spec.suspend else "ScaledToZero"
        message = f"{workload.ready}/{desired} replicas ready"
        return {
            "Stalled": ("False", "Healthy", message),
            "Reconciling": ("False", "Reconciled", message),
            "Ready": ("True", reason, message),
        }
    if workload.pods_refused:
        message = f"the engine pods are refused: {workload.pods_refused}"
        return {
            "Stalled": ("True", "PodsRefused", message),
            "Reconciling": ("False", "PodsRefused", message),
            "Ready": ("False", "PodsRefused", message),
        }
    message = f"{workload.ready}/{desired} replicas ready, {workload.updated}/{desired} updated" + (
        f"; unschedulable: {workload.unschedulable}" if workload.unschedulable else ""
    )
    # Every replica runs the current template but not all are ready: nothing rolls out, a
    # replica is starting or restarting (an engine that died comes back in the same pod).
    rolled_out = workload.current and workload.updated >= desired and workload.replicas == desired
    reason = "ReplicasNotReady" if rolled_out else "RollingOut"
    return {
        "Stalled": ("False", "Progressing", message),
        "Reconciling": ("True", reason, message),
        "Ready": ("False", reason, message),
    }


def _first_failing(failing_pods: tuple[str, ...]) -> str:
    """The first few failing pods, then how many more: one message, whatever the replicas."""
    shown = "; ".join(failing_pods[:MAX_FAILING_PODS_SHOWN])
    more = len(failing_pods) - MAX_FAILING_PODS_SHOWN
    return f"{shown}; and {more} more" if more > 0 else shown


def _available(spec: InferenceDeploymentSpec, workload: WorkloadState | None) -> ConditionFields:
    if spec.suspend:
        return ("False", "Suspended", "spec.suspend is true")
    if workload is not None and workload.ready > 0:
        return ("True", "MinimumReplicasAvailable", f"{workload.ready} replicas serve")
    if workload is not None and workload.desired == 0 and spec.routing.enabled:
        message = "scaled to zero; the router holds requests while a replica starts"
        return ("False", "ScaledToZero", message)
    return ("False", "NoReplicasAvailable", "no replica serves yet")


def _plan_summary(spec: InferenceDeploymentSpec, plan: Plan) -> str:
    topology = plan.topology
    assert topology is not None
    text = (
        f"{topology.pods_per_replica} pod(s) × {topology.gpus_per_pod} GPU(s) "
        f"({spec.resources.accelerator}) per replica"
    )
    if topology.kind != "Deployment":
        text += (
            f", a group on {topology.nodes_per_replica} nodes (tensor {topology.tensor} × "
            f"pipeline {topology.pipeline}) as {_GROUP_WORKLOAD[topology.kind]}"
        )
    if plan.memory is None:
        return text + f"; memory not estimated ({plan.memory_unknown_reason})"
    return text + f"; {plan.memory.required_gib}/{plan.memory.available_gib} GiB per GPU"


def _merge_conditions(
    old: list[dict[str, Any]], new: dict[str, ConditionFields], generation: int, now: str
) -> list[dict[str, Any]]:
    """Our conditions in a fixed order, then others' (e.g. the autoscaler's) untouched."""
    merged = [
        {
            **_condition(kind, new[kind], find_condition(old, kind), now),
            "observedGeneration": generation,
        }
        for kind in OWN_CONDITIONS
    ]
    return merged + [c for c in old if c.get("type") not in OWN_CONDITIONS]


def _merge_condition(
    conditions: list[dict[str, Any]], kind: str, new: ConditionFields, now: str
) -> list[dict[str, Any]]:
    """`conditions` with `kind` set to `new`, in its place or last."""
    previous = find_condition(conditions, kind)
    condition = _condition(kind, new, previous, now)
    if previous is None:
        return [*conditions, condition]
    return [condition if c is previous else c for c in conditions]


def _condition(
    kind: str, new: ConditionFields, previous: dict[str, Any] | None, now: str
) -> dict[str, Any]:
    """The condition `kind` as `new` says; its lastTransitionTime moves only when its status
    does."""
    status, reason, message = new
    since = now
    if previous is not None and previous.get("status") == status:
        since = previous.get("lastTransitionTime", now)
    return {
        "type": kind, "status": status, "reason": reason, "message": message,
        "lastTransitionTime": since,
    }  # fmt: skip


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str  # CamelCase
    message: str


def transition_events(old_status: dict[str, Any], new_status: dict[str, Any]) -> list[Event]:
    """Events for conditions that changed status or reason since the last status write."""
    events = []
    old = old_status.get("conditions", [])
    for condition in new_status["conditions"]:
        kind = condition["type"]
        if kind not in ("Ready", "Stalled"):
            continue
        before = find_condition(old, kind)
        if before and (before["status"], before["reason"]) == (
            condition["status"],
            condition["reason"],
        ):
            continue
        if kind == "Stalled" and condition["status"] == "True":
            events.append(Event("Warning", condition["reason"], condition["message"]))
        elif kind == "Ready" and condition["status"] == "True":
            events.append(Event("Normal", "Ready", condition["message"]))
        elif kind == "Ready" and before is not None and before["status"] == "True":
            events.append(Event("Warning", "NotReady", condition["message"]))
    return events


def invalid_spec_status(
    *, generation: int, message: str, old_status: dict[str, Any], now: str
) -> dict[str, Any]:
    """Status for a spec the typed model rejects (a rule the CRD schema could not express)."""
    conditions: dict[str, ConditionFields] = {
        "Ready": ("False", "InvalidSpec", message),
        "Reconciling": ("False", "Stalled", "waiting for a valid spec"),
        "Stalled": ("True", "InvalidSpec", message),
        "Planned": ("False", "InvalidSpec", message),
        "Available": ("False", "InvalidSpec", message),
    }
    return {
        "observedGeneration": generation,
        "conditions": _merge_conditions(
            old_status.get("conditions", []), conditions, generation, now
        ),
    }


_CREATED = {
    "Deployment": "created the Deployment, Service and PodDisruptionBudget",
    "LeaderWorkerSet": "created the LeaderWorkerSet, Service and PodDisruptionBudget",
    "StatefulSet": "created the StatefulSet groups, their headless Service, the Service and "
    "PodDisruptionBudget",
}


def rollout_event(
    before: dict[str, Any] | None, after: dict[str, Any] | None, kind: str = "Deployment"
) -> Event | None:
    """An event when applying the children created the workload or changed its spec (`kind`:
    the workload's; for StatefulSet groups, the first group's StatefulSet stands for all)."""
    if after is None:
        return None
    if before is None:
        return Event("Normal", "Created", _CREATED[kind])
    old, new = before["metadata"].get("generation"), after["metadata"].get("generation")
    if old == new:
        return None
    if "spec" in before and _all_but_replicas(before) == _all_but_replicas(after):
        # spec.suspend, or a new spec.replicas: the pods stay as they are, only their number
        # changes (a RolloutStarted here read as if every replica were replaced).
        was, now = before["spec"].get("replicas", 1), after["spec"].get("replicas", 1)
        return Event("Normal", "Scaled", f"{kind} scaled from {was} to {now} replicas")
    return Event("Normal", "RolloutStarted", f"{kind} spec changed (generation {old} -> {new})")


def _all_but_replicas(workload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in workload.get("spec", {}).items() if k != "replicas"}
