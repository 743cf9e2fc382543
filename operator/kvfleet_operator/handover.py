"""Handing a workload's replicas from the reconciler to an autoscaler (Builtin, HPA, KEDA):
who owns spec.replicas, by the server-side apply field managers."""

from __future__ import annotations

import logging
from typing import Any

from kvfleet_operator import api
from kvfleet_operator.apply import Cluster
from kvfleet_operator.autoscaling.spec import AutoscalingSpec

Status = dict[str, Any]

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


# status field: the replicas of a LeaderWorkerSet deleted to change its group size while an
# autoscaler owned them, until it is created again (`start_where_deleted`).
RECREATING_REPLICAS = "recreatingReplicas"


def replicas_to_recreate(workload: dict[str, Any], autoscaling: AutoscalingSpec | None) -> Status:
    """The status fields to write before the workload is deleted to be created again (written
    first, so that a pass that fails after the deletion loses nothing): under autoscaling, its
    replicas, which the rendered object leaves out; nothing otherwise."""
    if autoscaling is None:
        return {}
    return {RECREATING_REPLICAS: workload.get("spec", {}).get("replicas", 1)}


def start_where_deleted(
    main: dict[str, Any],
    before: dict[str, Any] | None,
    old_status: Status,
    autoscaling: AutoscalingSpec | None,
) -> Status:
    """The main workload about to be applied (`before`: as found, not being deleted). Created
    again after a group-size change, under autoscaling, it starts at the replicas the deleted
    one had (within minReplicas-maxReplicas), not at the API server's default of 1; the next
    pass hands spec.replicas to the autoscaler (`hand_replicas_to_autoscaler`). The count is
    cleared once the workload exists again, or when autoscaling no longer owns replicas
    (suspended, fixed replicas): the status fields to write."""
    replicas = old_status.get(RECREATING_REPLICAS)
    if replicas is None:
        return {}
    if before is None and autoscaling is not None and isinstance(replicas, int):
        replicas = min(max(replicas, autoscaling.min_replicas), autoscaling.max_replicas)
        main["spec"] = {"replicas": replicas, **main["spec"]}
        log.info(
            "%s/%s: created again at %d replicas, as before its group size changed",
            main["metadata"].get("namespace"), main["metadata"]["name"], replicas,
        )  # fmt: skip
    return {RECREATING_REPLICAS: None}
