"""What the autoscaler needs to know about a pod, read from its API object (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class PodFacts:
    """One pod of the child Deployment."""

    name: str  # pod name
    ip: str | None  # status.podIP, None until assigned
    ready_since: float | None  # when Ready turned True (epoch seconds); None while not ready
    unschedulable: bool  # the scheduler reported it Unschedulable
    deletion_cost: str | None  # current pod-deletion-cost annotation
    uid: str | None = None  # metadata.uid: a write to the pod names it (not another, not a new one)


def pod_facts(pod: dict[str, Any]) -> PodFacts | None:
    """The facts of `pod`, or None for a pod that is terminating (it is not capacity any more)."""
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return None
    conditions = {c.get("type"): c for c in status.get("conditions", [])}
    ready = conditions.get("Ready", {})
    scheduled = conditions.get("PodScheduled", {})
    ready_since = None
    if ready.get("status") == "True":
        ready_since = parse_time(ready.get("lastTransitionTime") or meta.get("creationTimestamp"))
    return PodFacts(
        name=meta["name"],
        ip=status.get("podIP") or None,
        ready_since=ready_since,
        unschedulable=scheduled.get("status") == "False"
        and scheduled.get("reason") == "Unschedulable",
        deletion_cost=(meta.get("annotations") or {}).get(DELETION_COST),
        uid=meta.get("uid"),
    )


def parse_time(text: str | None) -> float:
    """RFC 3339 time of the API server -> epoch seconds (0 when absent)."""
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def format_time(epoch: float) -> str:
    """Epoch seconds -> RFC 3339 in UTC, as the API server writes it."""
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
