"""The Builtin autoscaler's tick for one InferenceDeployment: read, decide, act, report.

    read   the InferenceDeployment, its child workload and pods; each ready pod's metrics (of a
           group of pods, the leader's: it serves the whole group); with minReplicas 0, the
           demand its router pods report (requests waiting, idle time)
    decide `decide(spec, observation, state)` (pure, decision.py)
    act    mark the scale-down victims (pod-deletion-cost) and write the Deployment's
           spec.replicas by server-side apply under the field manager `kvfleet-autoscaler`; a
           LeaderWorkerSet's spec.replicas (groups) likewise; for StatefulSet groups the count
           is status.autoscaling.desiredReplicas, which the reconciler renders
    report status.autoscaling (signals, desired, mode, last 10 decisions, the saved state) and
           the ScalingLimited condition; never the InferenceDeployment's spec

All API traffic goes through `kvfleet_operator.apply.Cluster`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import httpx
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from kvfleet_operator import api, metrics
from kvfleet_operator.apply import (
    Cluster,
    api_error_summary,
    foreign_controller,
    patch_status_as_read,
    read_again,
)
from kvfleet_operator.autoscaling.actuators import EXTERNAL_KINDS
from kvfleet_operator.autoscaling.decision import Decision, decide
from kvfleet_operator.autoscaling.pods import DELETION_COST, PodFacts, pod_facts
from kvfleet_operator.autoscaling.report import autoscaling_status, with_condition
from kvfleet_operator.autoscaling.samples import EngineSample, Observation, PodObservation
from kvfleet_operator.autoscaling.sources import query_prometheus, scrape_pods, scrape_routers
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.autoscaling.state import ScalerState
from kvfleet_operator.models import RoutingSpec
from kvfleet_operator.render import selector_string
from kvfleet_operator.render_group import leader_selector
from kvfleet_operator.render_router import ROUTER_PORT, router_selector_string
from kvfleet_operator.topology import group_name

log = logging.getLogger(__name__)

VICTIM_DELETION_COST = (
    "-1000"  # lower than any unannotated pod (0): the ReplicaSet removes it first
)
IDLE_PERIOD_SECONDS = 5.0  # next look when there is nothing to scale yet
STATUS_WRITE_ATTEMPTS = 3  # conditional writes of status.autoscaling before a conflict is raised
# What a tick meets in a working cluster and retries: the API server answering an error,
# restarting or slow (kubernetes_asyncio over aiohttp), an engine or Prometheus unreachable.
EXPECTED_ERRORS = (ApiException, aiohttp.ClientError, httpx.HTTPError, OSError, TimeoutError)


class Stopped(Protocol):
    """A stop flag (loops.Flag, or kopf's DaemonStopped): falsy while running; `wait(timeout)`
    sleeps until stop or timeout."""

    def __bool__(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> Awaitable[Any]: ...


async def run_autoscaler(cluster: Cluster, namespace: str, name: str, stopped: Stopped) -> None:
    """Tick every behavior.syncPeriodSeconds until `stopped` (kvfleet_operator.loops starts one
    such task per autoscaled InferenceDeployment). A failed tick is logged and retried on the
    next one: the replicas stay as they are meanwhile."""
    # httpx logs every request at INFO: one line per pod per tick would drown the operator log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    async with httpx.AsyncClient(trust_env=False) as http:
        while not stopped:
            period = IDLE_PERIOD_SECONDS
            try:
                _, period = await autoscale_once(cluster, http, namespace, name, time.time())
            except EXPECTED_ERRORS as exc:  # one line: an API error's text is its headers and body
                log.warning(
                    "autoscaling %s/%s failed (%s); retrying in %.0f s",
                    namespace,
                    name,
                    api_error_summary(exc),
                    period,
                )
            except Exception:  # a bug: the traceback is worth its lines
                log.exception("autoscaling %s/%s failed; retrying", namespace, name)
            await stopped.wait(period)


async def autoscale_once(
    cluster: Cluster, http: httpx.AsyncClient, namespace: str, name: str, now: float
) -> tuple[Decision | None, float]:
    """One tick. Returns the decision, or None when there is nothing to scale (no autoscaling,
    another controller, suspended, invalid spec, child Deployment not created yet), and the
    seconds until the next tick."""
    body = await cluster.get(api.API_VERSION, api.INFERENCE_DEPLOYMENT, name, namespace)
    idle = None, IDLE_PERIOD_SECONDS
    spec = builtin_spec(body)
    if body is None or spec is None:
        return idle
    raw_spec = body.get("spec") or {}
    await _remove_external_autoscalers(cluster, body)
    workload = await scaled_workload(cluster, body)
    if workload is None:
        return idle

    pods = [
        facts
        for pod in await cluster.list("v1", "Pod", namespace, workload.pod_selector)
        if (facts := pod_facts(pod)) is not None
    ]
    samples = await _read_metrics(spec, http, namespace, pods, now)
    # The routers' demand decides only the moves to and from zero (minReplicas 0).
    demand, idle_after = None, None
    routing = RoutingSpec.model_validate(raw_spec.get("routing") or {})
    if spec.min_replicas == 0 and routing.enabled:
        routers = [
            facts
            for pod in await cluster.list("v1", "Pod", namespace, router_selector_string(name))
            if (facts := pod_facts(pod)) is not None
        ]
        demand = await scrape_routers(http, routers, ROUTER_PORT)
        idle_after = float(routing.scale_to_zero_after_seconds)
    observation = Observation(
        now=now,
        replicas=workload.replicas,
        ready_replicas=sum(1 for pod in pods if pod.ready_since is not None),
        unschedulable_replicas=sum(1 for pod in pods if pod.unschedulable),
        pods=tuple(PodObservation(p.name, p.ready_since, samples.get(p.name)) for p in pods),
        demand=demand,
        scale_to_zero_after_s=idle_after,
    )
    status = body.get("status") or {}
    state = ScalerState.from_dict((status.get("autoscaling") or {}).get("state"))
    decision = decide(spec, observation, state)
    metrics.record(namespace, name, decision, observation)

    if workload.kind == "Deployment":  # the groups go from the highest index down
        await _mark_victims(cluster, namespace, pods, decision.victims)
    if decision.desired_replicas != observation.replicas:
        if workload.kind != "StatefulSet":  # StatefulSet groups: the reconciler reads
            await cluster.scale(  # status.autoscaling.desiredReplicas (written below)
                namespace,
                workload.name,
                decision.desired_replicas,
                api_version=workload.api_version,
                kind=workload.kind,
            )
        verb = "ScaledUp" if decision.desired_replicas > observation.replicas else "ScaledDown"
        message = (
            f"{observation.replicas} -> {decision.desired_replicas} replicas ({decision.mode}): "
            f"{decision.reason}"
        )
        log.info("%s/%s %s %s", namespace, name, verb, message)
        await cluster.post_event(body, "Normal", verb, message)
    written = await _write_autoscaling(
        cluster, body, autoscaling_status(spec, decision, observation)
    )
    if written is not None:
        await _write_condition(cluster, written, spec, decision, now)
    return decision, spec.behavior.sync_period_seconds


def builtin_spec(body: dict[str, Any] | None) -> AutoscalingSpec | None:
    """spec.autoscaling of `body` when the Builtin autoscaler is to scale it; None when there is
    nothing for it to do: no object or one being deleted, no autoscaling, suspended, an invalid
    spec (the reconciler reports it as Stalled), or HPA / KEDA owning the replicas."""
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    raw_spec = body.get("spec") or {}
    if not raw_spec.get("autoscaling") or raw_spec.get("suspend"):
        return None
    try:
        spec = AutoscalingSpec.model_validate(raw_spec["autoscaling"])
    except ValidationError:
        return None
    return spec if spec.controller == "Builtin" else None


@dataclass(frozen=True)
class ScaledWorkload:
    """What the autoscaler scales: replicas are pods of a Deployment, or groups of pods (a
    LeaderWorkerSet's replicas, or the number of StatefulSet groups); only a group's leader
    serves metrics."""

    kind: str  # Deployment, LeaderWorkerSet or StatefulSet
    api_version: str
    name: str  # the object whose spec.replicas is written (none for StatefulSet groups)
    replicas: int
    pod_selector: str  # the pods whose metrics count: every pod, or the groups' leaders


async def scaled_workload(cluster: Cluster, body: dict[str, Any]) -> ScaledWorkload | None:
    """The child workload of the InferenceDeployment `body`, or None while none exists yet.
    An object of its name that another owner controls is not scaled: the reconciler reports
    it (NameInUse)."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    pods = selector_string(name)
    deployment = await cluster.get("apps/v1", "Deployment", name, namespace)
    if deployment is not None and foreign_controller(deployment, body) is None:
        replicas = int(deployment.get("spec", {}).get("replicas", 1))
        return ScaledWorkload("Deployment", "apps/v1", name, replicas, pods)
    groups = [
        sts
        for sts in await cluster.list("apps/v1", "StatefulSet", namespace, pods)
        if foreign_controller(sts, body) is None
    ]
    if groups:
        leaders = _with_labels(pods, leader_selector("StatefulSet"))
        return ScaledWorkload("StatefulSet", "apps/v1", name, len(groups), leaders)
    lws = await cluster.get(
        api.LEADER_WORKER_SET_API, "LeaderWorkerSet", group_name(name), namespace
    )
    if lws is not None and foreign_controller(lws, body) is None:
        replicas = int(lws.get("spec", {}).get("replicas", 1))
        leaders = _with_labels(pods, leader_selector("LeaderWorkerSet"))
        return ScaledWorkload(
            "LeaderWorkerSet", api.LEADER_WORKER_SET_API, group_name(name), replicas, leaders
        )
    return None


def _with_labels(selector: str, labels: dict[str, str]) -> str:
    return ",".join([selector, *(f"{k}={v}" for k, v in labels.items())])


async def _remove_external_autoscalers(cluster: Cluster, body: dict[str, Any]) -> None:
    """After a switch back to Builtin, the HPA or ScaledObject rendered for controller HPA/KEDA
    would fight over the replicas: delete the ones this InferenceDeployment owns."""
    meta = body["metadata"]
    for api_version, kind in EXTERNAL_KINDS:
        found = await cluster.get(api_version, kind, meta["name"], meta["namespace"])
        owners = (found or {}).get("metadata", {}).get("ownerReferences", [])
        if any(owner.get("uid") == meta["uid"] for owner in owners):
            try:
                await cluster.delete(api_version, kind, meta["name"], meta["namespace"])
            except ApiException as exc:  # e.g. 403: the install's RBAC grants no delete
                log.warning(
                    "%s/%s: could not delete the %s rendered for the previous controller (%s); "
                    "delete it by hand or it keeps scaling too",
                    meta["namespace"],
                    meta["name"],
                    kind,
                    exc.reason,
                )
                continue
            log.info(
                "%s/%s: deleted %s (controller is Builtin now)",
                meta["namespace"],
                meta["name"],
                kind,
            )
            await cluster.post_event(
                body, "Normal", "ExternalAutoscalerRemoved", f"deleted {kind} {meta['name']}"
            )


async def _read_metrics(
    spec: AutoscalingSpec,
    http: httpx.AsyncClient,
    namespace: str,
    pods: list[PodFacts],
    now: float,
) -> dict[str, EngineSample | None]:
    if spec.source == "Prometheus":
        assert spec.prometheus is not None, "validated by AutoscalingSpec"
        return await query_prometheus(http, spec.prometheus.url, namespace, pods, now)
    return await scrape_pods(http, pods, now)


async def _mark_victims(
    cluster: Cluster, namespace: str, pods: list[PodFacts], victims: tuple[str, ...]
) -> None:
    """pod-deletion-cost: the chosen victims get a low cost, former victims lose theirs (the
    annotation is owned by the autoscaler's field manager, so applying without it removes it).
    Each write names the pod's uid: a pod deleted since it was listed is then a 409 (server-side
    apply would otherwise try to create it: 422, a pod without containers), and skipped: the
    tick goes on to scale."""
    for pod in pods:
        wanted = VICTIM_DELETION_COST if pod.name in victims else None
        if pod.deletion_cost == wanted:
            continue
        annotations = {DELETION_COST: wanted} if wanted else {}
        metadata = {"name": pod.name, "namespace": namespace, "annotations": annotations}
        if pod.uid is not None:
            metadata["uid"] = pod.uid
        try:
            await cluster.apply(
                {"apiVersion": "v1", "kind": "Pod", "metadata": metadata},
                field_manager=api.AUTOSCALER_FIELD_MANAGER,
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            log.debug("%s/%s: pod gone before its deletion cost was written", namespace, pod.name)


async def _write_autoscaling(
    cluster: Cluster, body: dict[str, Any], autoscaling: dict[str, Any]
) -> dict[str, Any] | None:
    """Write status.autoscaling, conditional on the resourceVersion of `body` (read when the
    tick began). On a conflict the object is read again: if it no longer asks for the Builtin
    autoscaler (autoscaling removed or handed to HPA / KEDA, suspended, deleted), the reconciler
    has cleared status.autoscaling meanwhile and this tick, decided on the old spec, must not
    put it back: nothing is written. Otherwise it is written on the version read. Returns the
    object as written, None when not written."""
    for attempt in range(1, STATUS_WRITE_ATTEMPTS + 1):
        meta = body["metadata"]
        try:
            return await patch_status_as_read(cluster, body, {"autoscaling": autoscaling})
        except ApiException as exc:
            if exc.status != 409 or attempt == STATUS_WRITE_ATTEMPTS:
                raise
        fresh = await read_again(cluster, body)
        if fresh is None or builtin_spec(fresh) is None:
            log.info(
                "%s/%s: autoscaling changed during the tick; its status is not written",
                meta["namespace"],
                meta["name"],
            )
            return None
        body = fresh
    return None


async def _write_condition(
    cluster: Cluster, body: dict[str, Any], spec: AutoscalingSpec, decision: Decision, now: float
) -> None:
    """Set ScalingLimited when it changed. `conditions` is one list shared with the reconciler,
    so the write is conditional on the resourceVersion just read: on a conflict it is left to
    the next tick instead of overwriting the reconciler's conditions with stale ones."""
    meta = body["metadata"]
    conditions = (body.get("status") or {}).get("conditions", [])
    updated = with_condition(conditions, decision, spec, meta.get("generation", 0), now)
    if updated == conditions:
        return
    try:
        await patch_status_as_read(cluster, body, {"conditions": updated})
    except ApiException as exc:
        if exc.status != 409:
            raise
        log.debug("%s/%s: conditions changed meanwhile; next tick", meta["namespace"], meta["name"])
