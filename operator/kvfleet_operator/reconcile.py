"""One reconcile of one InferenceDeployment, in the order of DESIGN §3: read, plan, render,
apply, status. Level-based and idempotent: run it as often as you like; when nothing changed it
writes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kvfleet_operator import api
from kvfleet_operator.accelerators import resolve_accelerator
from kvfleet_operator.apply import (
    Cluster,
    NotOwned,
    api_error_summary,
    conflicted,
    patch_status_as_read,
    read_again,
    refused,
)
from kvfleet_operator.autoscaling.actuators import EXTERNAL_KIND
from kvfleet_operator.handover import (
    hand_replicas_to_autoscaler,
    replicas_to_recreate,
    start_where_deleted,
)
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.models import InferenceDeploymentSpec
from kvfleet_operator.plan import ClusterFeatures, Plan, plan_deployment
from kvfleet_operator.plan_checks import Problem
from kvfleet_operator.reconcile_inputs import (
    read_accelerator_profiles,
    read_api_key_digest,
    read_model_architecture,
)
from kvfleet_operator.render import labels, render_children
from kvfleet_operator.render_group import render_group_key
from kvfleet_operator.status import (
    compute_status,
    invalid_spec_status,
    rollout_event,
    transition_events,
)
from kvfleet_operator.topology_groups import group_count, recreate_message, size_change_refused
from kvfleet_operator.topology_workloads import (
    Workloads,
    delete_leader_worker_set,
    prune,
    prune_optional,
    read_workloads,
    replace_group_pods,
)

log = logging.getLogger(__name__)

# One reconcile at a time per object: change handlers, the resync timer and child events all
# end up here.
_locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
# Status writes conditional on the resourceVersion read: tries before a conflict is raised.
STATUS_WRITE_ATTEMPTS = 3
Status = dict[str, Any]


async def reconcile(
    cluster: Cluster,
    namespace: str,
    name: str,
    headers: HeaderCache,
    *,
    host_path_prefixes: tuple[str, ...] | None = None,
) -> None:
    """`host_path_prefixes`: where a file:// model may be (`plan_deployment`)."""
    async with _locks[(namespace, name)]:
        body = await cluster.get(api.API_VERSION, api.INFERENCE_DEPLOYMENT, name, namespace)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # gone: owner references let the garbage collector remove the children
        await _reconcile(cluster, headers, body, host_path_prefixes)


async def _reconcile(
    cluster: Cluster,
    headers: HeaderCache,
    body: dict[str, Any],
    host_path_prefixes: tuple[str, ...] | None,
) -> None:
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta["generation"]
    old_status = body.get("status") or {}
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        spec = InferenceDeploymentSpec.model_validate(body.get("spec", {}))
    except ValidationError as exc:
        message = "; ".join(_describe(error) for error in exc.errors())

        def invalid(old: Status) -> Status:
            return invalid_spec_status(
                generation=generation, message=message, old_status=old, now=now
            )

        await _write_status(cluster, body, invalid)
        return

    profiles, invalid_profiles = await read_accelerator_profiles(cluster)
    profile = resolve_accelerator(spec.resources.accelerator, profiles)
    features = ClusterFeatures(
        leader_worker_set=await cluster.serves(api.LEADER_WORKER_SET_API, "leaderworkersets"),
        service_monitor=await cluster.has_crd(api.SERVICE_MONITOR_CRD),
        keda=await cluster.has_crd(api.KEDA_SCALED_OBJECT_CRD),
    )
    architecture = await read_model_architecture(cluster, headers, namespace, spec.model)
    plan = plan_deployment(
        name, spec, profile, architecture, features, host_path_prefixes=host_path_prefixes,
        invalid_profile=invalid_profiles.get(spec.resources.accelerator),
    )  # fmt: skip
    planned = plan.topology.kind if plan.topology is not None else None
    controller = spec.autoscaling.controller if spec.autoscaling is not None else "Builtin"
    external_autoscaler = (
        EXTERNAL_KIND.get(controller) if spec.effective_replicas() is None else None
    )
    found = await read_workloads(
        cluster, body,
        leader_worker_set=features.leader_worker_set, router=spec.routing.enabled,
        autoscaler=external_autoscaler,
    )  # fmt: skip
    groups = group_count(spec, old_status, len(found.statefulsets))

    def status_of(plan: Plan, found: Workloads) -> Callable[[Status], Status]:
        """The status for `plan` and the workload `found`, built on a status read (the one
        this pass read, or a newer one after a conflict: _write_status)."""

        def build(old: Status) -> Status:
            return compute_status(
                name=name,
                namespace=namespace,
                generation=generation,
                spec=spec,
                plan=plan,
                workload=found.summary(planned, groups),
                old_status=old,
                now=now,
            )

        return build

    workload_generation: int | None = None  # of the workload this pass applied
    recorded: Status = {}  # status fields of this pass's writes (workloadGeneration, ...)
    if plan.ok:
        assert profile is not None and planned is not None
        children = render_children(
            name,
            namespace,
            spec,
            plan,
            profile,
            service_monitor=features.service_monitor,
            groups=groups,
            api_key_digest=await read_api_key_digest(cluster, namespace, spec),
        )
        if plan.topology is not None and plan.topology.pods_per_replica > 1:
            await ensure_group_key(cluster, body, name, namespace)
        before = found.main(planned)
        # A workload being deleted (a LeaderWorkerSet whose group size changes) is left to go;
        # a later pass creates it again.
        leaving = before is not None and bool(before["metadata"].get("deletionTimestamp"))
        autoscaling = spec.autoscaling if spec.effective_replicas() is None else None
        if before is not None and not leaving and autoscaling and planned != "StatefulSet":
            await hand_replicas_to_autoscaler(cluster, before, autoscaling.min_replicas)
        main = _main_child(children, planned, name)
        told = old_status.get("workloadGeneration")
        try:  # every child before any is applied: a pass stopped here leaves nothing half done
            for child in children:
                await cluster.check_owned(child, body)
        except NotOwned as exc:  # someone else's object of the name: left as it is
            taken = dataclasses.replace(plan, problems=(Problem("NameInUse", str(exc)),))
            await _write_status(cluster, body, status_of(taken, found))
            raise
        for child in children:
            if child is main and leaving:
                continue
            if child is main:
                recorded.update(start_where_deleted(child, before, old_status, autoscaling))
            try:
                applied = await cluster.apply(child, owner=body)
            except Exception as exc:
                if not refused(exc):  # conflicts, throttling, server errors: only retried
                    raise
                error = api_error_summary(exc)
                if child is main and before and size_change_refused(before, child, error):
                    kept = replicas_to_recreate(before, autoscaling)
                    if kept:  # before deleting: a pass that fails later must not lose it
                        body = await patch_status_as_read(cluster, body, kept) or body
                    await delete_leader_worker_set(cluster, before)
                    message = recreate_message(before, child, error)
                    await cluster.post_event(body, "Warning", "RecreatingLeaderWorkerSet", message)
                    continue
                # The API server (or an admission webhook) refuses the object as rendered: say
                # so in status, then let the handler's retries go on (a later spec may pass).
                problem = Problem(
                    "ApplyRejected",
                    f"the API server refused {child['kind']} {child['metadata']['name']}: {error}",
                )
                rejected = dataclasses.replace(plan, problems=(problem,))
                await _write_status(cluster, body, status_of(rejected, found))
                raise
            if child is main:
                # Told at once: a crash or a failed apply later in this pass must not lose it.
                # A pass that ended between the apply and the event (the operator killed) left
                # status.workloadGeneration behind the workload's: the next pass tells it then.
                # The event's name is the rollout's own, so telling it twice makes one event.
                workload_generation = applied["metadata"].get("generation")
                if workload_generation is not None:
                    recorded["workloadGeneration"] = workload_generation
                event = rollout_event(before, applied, planned)
                if event is None and _untold(told, before, workload_generation):
                    event = rollout_event({"metadata": {"generation": told}}, applied, planned)
                if event is not None:
                    await cluster.post_event(
                        body, event.type, event.reason, event.message,
                        name=_event_name(meta, event.reason, workload_generation),
                    )  # fmt: skip
        await prune(cluster, namespace, children, found, meta["uid"])
        if old_status.get("observedGeneration") != generation:  # the spec changed (or is new)
            await prune_optional(cluster, namespace, name, children, meta["uid"])
        found = await read_workloads(
            cluster, body,
            leader_worker_set=features.leader_worker_set, router=spec.routing.enabled,
            autoscaler=external_autoscaler,
        )  # fmt: skip
        if planned == "StatefulSet":
            replaced = await replace_group_pods(
                cluster, namespace, found, spec.rollout.max_unavailable
            )
            if replaced:
                message = f"replacing the pods {', '.join(replaced)} (broken or outdated groups)"
                log.info("%s/%s: %s", namespace, name, message)
                await cluster.post_event(body, "Normal", "GroupsReplaced", message)
    else:
        log.debug("%s/%s not rolled out: %s", namespace, name, plan.problems[0].message)

    build = status_of(plan, found)
    await _write_status(cluster, body, lambda old: {**build(old), **recorded})


def _untold(told: Any, before: dict[str, Any] | None, generation: int | None) -> bool:
    """Whether the workload's generation moved past the last one told by an earlier pass."""
    return (
        isinstance(told, int)
        and before is not None
        and generation is not None
        and generation > told
    )


def _event_name(meta: dict[str, Any], reason: str, generation: int | None) -> str | None:
    """A rollout's event name, unique to the InferenceDeployment (its uid) and the workload's
    generation; None (a generated name) for other events."""
    if reason != "RolloutStarted" or generation is None:
        return None
    return f"{meta['name']}.rollout.{meta['uid'][:8]}.{generation}"


def _main_child(children: list[dict[str, Any]], planned: str, name: str) -> dict[str, Any] | None:
    """The rendered object whose creation or generation tells a rollout (as
    `Workloads.main`): the engine Deployment (not the router's), the LeaderWorkerSet, or the
    first StatefulSet group."""
    return next(
        (
            child
            for child in children
            if child["kind"] == planned
            and (planned != "Deployment" or child["metadata"]["name"] == name)
        ),
        None,
    )


async def _write_status(
    cluster: Cluster, body: dict[str, Any], build: Callable[[Status], Status]
) -> None:
    """Write the status `build` makes of the one read, when it changed (an unchanged status is
    not written: no watch event, no loop). The write is conditional on the resourceVersion
    read: the autoscaler writes status too, and `conditions` (its ScalingLimited among ours) is
    one list that a merge patch replaces whole, so a write built on a stale read would put back
    the condition it had replaced. On a conflict the object is read again and the status built
    anew on it."""
    for attempt in range(1, STATUS_WRITE_ATTEMPTS + 1):
        old = body.get("status") or {}
        new = build(old)
        if all(old.get(key) == value for key, value in new.items()):
            return
        try:
            await patch_status_as_read(cluster, body, new)
        except Exception as exc:
            if not conflicted(exc) or attempt == STATUS_WRITE_ATTEMPTS:
                raise
            fresh = await read_again(cluster, body)
            if fresh is None:
                return  # deleted meanwhile
            body = fresh
            continue
        for event in transition_events(old, new):
            await cluster.post_event(body, event.type, event.reason, event.message)
        return


def _describe(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"])
    return f"spec.{where}: {error['msg']}" if where else f"spec: {error['msg']}"


async def ensure_group_key(
    cluster: Cluster, owner: dict[str, Any], name: str, namespace: str
) -> None:
    """The Secret of the groups' step-channel key, created with a random key where it is
    absent (and never changed: the ranks of a running group share it). One left by a deleted
    deployment of the same name (owned by another uid, or being deleted) is waited out: its
    key would vanish under the new groups. Where the operator may not create Secrets, the ranks
    start on the engine's default key (their reference to the Secret is optional), and an
    event says so once."""
    secret = render_group_key(name, namespace, labels(name), secrets.token_urlsafe(32))
    secret_name = secret["metadata"]["name"]
    try:
        if await cluster.create(secret, owner=owner):
            return
        found = await cluster.get("v1", "Secret", secret_name, namespace)
    except Exception as exc:
        if not refused(exc):  # conflicts, throttling, server errors: the pass is retried
            raise
        message = (
            f"could not create or read Secret {secret_name}: {api_error_summary(exc)}; the "
            "groups' ranks join on the engine's default key, so only the NetworkPolicy keeps "
            "other pods from joining a group (grant the operator get and create on secrets)"
        )
        await cluster.post_event(owner, "Warning", "GroupKeyNotCreated", message,
                                 name=f"{name}.group-key-not-created")  # fmt: skip
        return
    if found is None:
        raise RuntimeError(f"Secret {secret_name} went away as it was created; trying again")
    uid = owner["metadata"]["uid"]
    owners = [ref.get("uid") for ref in found["metadata"].get("ownerReferences", [])]
    if found["metadata"].get("deletionTimestamp") or uid not in owners:
        raise RuntimeError(
            f"Secret {secret_name} belongs to an earlier InferenceDeployment of this name "
            "(another uid, or being deleted); waiting for the garbage collector to remove it"
        )
