"""Handing a workload's replicas from the reconciler to an autoscaler (Builtin, HPA, KEDA):
who owns spec.replicas, by the server-side apply field managers."""

from __future__ import annotations

import logging
from typing import Any

from kvfleet_operator import api
from kvfleet_operator.apply import Cluster

log = logging.getLogger(__name__)


async def hand_replicas_to_autoscaler(
    cluster: Cluster, workload: dict[str, Any], min_replicas: int
) -> None:
    """Switching from fixed replicas (or from spec.suspend) to autoscaling: if only the
    reconciler owns the child's spec.replicas, server-side apply without the field would delete
    it and the Deployment (or LeaderWorkerSet) would fall back to 1 replica. The autoscaler's
    field manager takes over the current value first. A count below `min_replicas` is raised to
    it whoever owns it: an HPA leaves a target at zero replicas alone (ScalingDisabled), so a
    deployment resumed, or handed over by Builtin at zero, would stay at 0 for good."""
    current = workload.get("spec", {}).get("replicas", 1)
    handed = not owns_replicas(workload, api.FIELD_MANAGER) or owns_replicas(
        workload, api.AUTOSCALER_FIELD_MANAGER
    )
    if handed and current >= min_replicas:
        return
    meta = workload["metadata"]
    replicas = max(current, min_replicas)
    await cluster.scale(
        meta["namespace"],
        meta["name"],
        replicas,
        api_version=workload["apiVersion"],
        kind=workload["kind"],
    )
    log.info(
        "%s/%s: replicas (%d) handed to the autoscaler", meta["namespace"], meta["name"], replicas
    )


def owns_replicas(obj: dict[str, Any], manager: str) -> bool:
    """Whether `manager` owns spec.replicas of `obj` according to its managedFields."""
    for entry in obj["metadata"].get("managedFields", []):
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            if "f:replicas" in entry.get("fieldsV1", {}).get("f:spec", {}):
                return True
    return False
