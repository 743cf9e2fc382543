"""What the Builtin autoscaler reports, pure: status.autoscaling (what a user reads with kubectl,
plus the state the next tick starts from) and the ScalingLimited condition."""

from __future__ import annotations

from typing import Any

from kvfleet_operator.autoscaling.decision import DESIRED_ABOVE_MAX, DESIRED_BELOW_MIN, Decision
from kvfleet_operator.autoscaling.pods import format_time
from kvfleet_operator.autoscaling.samples import Observation
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.status import SCALING_LIMITED

CONDITION = SCALING_LIMITED


def autoscaling_status(
    spec: AutoscalingSpec, decision: Decision, observation: Observation
) -> dict[str, Any]:
    """status.autoscaling (pure): what a user reads with kubectl, plus the saved state."""
    signals = [
        {
            "name": s.name,
            "value": None if s.value is None else round(s.value, 4),
            "target": s.target,
            "desiredReplicas": s.desired,
        }
        for s in decision.signals
    ]
    shown = [s for s in decision.signals if s.value is not None]
    summary = ", ".join(f"{_short(s.name)} {s.value:.3g}/{s.target:.3g}" for s in shown)
    return {
        "controller": spec.controller,
        "source": spec.source,
        "currentReplicas": observation.replicas,
        "readyReplicas": observation.ready_replicas,
        "desiredReplicas": decision.desired_replicas,
        "mode": decision.mode,
        "reason": decision.reason,
        "summary": f"{decision.mode} {summary}".strip() if summary else decision.mode,
        "lastDecisionTime": format_time(observation.now),
        "signals": signals,
        "history": [
            {
                "time": format_time(event.time),
                "fromReplicas": event.from_replicas,
                "toReplicas": event.to_replicas,
                "reason": event.reason,
            }
            for event in decision.state.events
        ],
        "state": decision.state.to_dict(),
    }


def _short(signal: str) -> str:
    return {
        "generationTokenRate": "gen",
        "promptTokenRate": "prompt",
        "kvCacheUtilization": "kv",
        "waitingRequestsPerReplica": "queue",
    }.get(signal, signal)


def with_condition(
    conditions: list[dict[str, Any]],
    decision: Decision,
    spec: AutoscalingSpec,
    generation: int,
    now: float,
) -> list[dict[str, Any]]:
    """The conditions list with ScalingLimited set from the decision, others untouched (pure).
    Messages change only with the situation, so a steady state writes nothing."""
    messages = {
        DESIRED_ABOVE_MAX: f"the signals ask for more than maxReplicas ({spec.max_replicas})",
        DESIRED_BELOW_MIN: f"the signals ask for fewer than minReplicas ({spec.min_replicas})",
    }
    if decision.limited:
        status, reason = "True", decision.limited
        message = messages.get(reason, decision.reason)
    else:
        status, reason, message = "False", "DesiredWithinRange", "the desired count is reachable"
    previous = next((c for c in conditions if c.get("type") == CONDITION), None)
    since = format_time(now)
    if previous is not None and previous.get("status") == status:
        since = previous.get("lastTransitionTime", since)
    condition = {
        "type": CONDITION,
        "status": status,
        "reason": reason,
        "message": message[:1024],
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }
    if previous == condition:
        return conditions
    return [c for c in conditions if c.get("type") != CONDITION] + [condition]
