"""The operator under cluster faults: an API server that does not answer, a Lease renewal that
hangs, someone else's object under a child's name. What a user sees: a pass that fails in
time (and is retried), a leader that stops leading by its deadline, and a status that names
the object in the way instead of an object taken over."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from test_leadership import LeaseStore
from test_reconcile import MemoryCluster, infd

from kvfleet_operator import apply, leadership
from kvfleet_operator.apply import RESOURCES, Cluster, NotOwned
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.leadership import Leadership
from kvfleet_operator.reconcile import reconcile

# -- an API server that accepts the connection and never answers -------------------------------


async def test_a_request_the_api_server_never_answers_fails_in_time(monkeypatch) -> None:
    """A half-open connection (a control-plane node gone, a black-holed network): the request
    fails after REQUEST_TIMEOUT_SECONDS with a line that says so, instead of holding the
    reconcile (and its per-object lock) or the resync loop for good."""
    monkeypatch.setattr(apply, "REQUEST_TIMEOUT_SECONDS", 0.3)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cluster = Cluster(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as raised:
            await asyncio.wait_for(cluster.get("v1", "Pod", "p", "ns"), 10)
    finally:
        await cluster.close()
        server.close()
    assert time.monotonic() - started < 5
    assert apply.api_error_summary(raised.value) == (
        "TimeoutError: GET /api/v1/namespaces/ns/pods/p: no answer from the API server in 0.3 s"
    )


async def test_a_leader_whose_renewal_hangs_stops_leading_by_its_deadline(monkeypatch) -> None:
    """The Lease GET never returns: the leader gives up leading within RENEW_DEADLINE_SECONDS
    (the standby takes the Lease after LEASE_SECONDS), not two leaders for as long as the
    request hangs."""
    monkeypatch.setattr(leadership, "RENEW_DEADLINE_SECONDS", 0.3)
    monkeypatch.setattr(leadership, "RENEW_SECONDS", 0.05)

    class HangingStore(LeaseStore):
        hang = False

        async def get(self, api_version: str, kind: str, name: str, namespace: str):
            if self.hang:
                await asyncio.Event().wait()
            return await super().get(api_version, kind, name, namespace)

    store = HangingStore()
    leader = Leadership(store, "kvfleet-system", "operator-a")  # type: ignore[arg-type]
    await leader._round()
    assert leader.leading
    store.hang = True
    lost: list[str] = []
    await asyncio.wait_for(leader.run(lost.append), 5)
    assert not leader.leading
    assert lost == ["could not renew the Lease kvfleet-system/kvfleet-operator for 0 s"]


# -- the real apply layer over an in-memory API server -------------------------------------------

_KINDS = {plural: kind for (_, kind), (plural, _) in RESOURCES.items()}


class Transport:
    """`call_api` of kubernetes_asyncio's ApiClient, answered by a MemoryCluster: the real
    `Cluster` (its ownership check, its paths) over the fake store."""

    def __init__(self, store: MemoryCluster) -> None:
        self.store = store

    async def call_api(self, path: str, method: str, **options: Any) -> Any:
        query = dict(options.get("query_params") or [])
        body = options.get("body")
        parts = path.strip("/").split("/")
        api_version = parts[1] if parts[0] == "api" else "/".join(parts[1:3])
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        namespace = None
        if rest[:1] == ["namespaces"] and len(rest) > 2:
            namespace, rest = rest[1], rest[2:]
        if not rest:  # discovery: nothing optional is served
            raise ApiException(status=404, reason="Not Found")
        kind, name = _KINDS[rest[0]], (rest[1] if len(rest) > 1 else None)
        if method == "GET" and name is None:
            selector = query.get("labelSelector", "")
            return {"items": await self.store.list(api_version, kind, namespace, selector)}
        if method == "GET":
            found = await self.store.get(api_version, kind, name, namespace)
            if found is None:
                raise ApiException(status=404, reason="Not Found")
            return found
        if method == "PATCH" and rest[-1] == "status":
            version = (body.get("metadata") or {}).get("resourceVersion")
            return await self.store.patch_status(
                api_version, kind, name, namespace, body["status"], resource_version=version
            )
        if method == "PATCH":
            return await self.store.apply(copy.deepcopy(body))
        if method == "POST" and kind == "Event":
            await self.store.post_event({}, body["type"], body["reason"], body["message"])
            return body
        if method == "DELETE":
            if not await self.store.delete(api_version, kind, name, namespace):
                raise ApiException(status=404, reason="Not Found")
            return {}
        raise AssertionError(f"unexpected {method} {path}")


def users_deployment() -> dict[str, Any]:
    """A Deployment a user made by hand, named as the InferenceDeployment: no owner."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llama", "namespace": "ns", "labels": {"app": "mine"}},
        "spec": {"replicas": 3, "template": {"spec": {"containers": [{"image": "mine:1"}]}}},
    }


async def test_someone_elses_object_of_a_childs_name_is_reported_not_taken_over() -> None:
    """Before, the forced server-side apply took the user's Deployment over: its template
    replaced, the InferenceDeployment made its controller (deleting the InferenceDeployment
    then deleted it). Now it is left as it is; status says which object is in the way
    (Stalled/NameInUse, with an event), the pass fails (retried with backoff), and once the
    object is gone the next pass creates the child."""
    store = MemoryCluster()
    store.add(infd(replicas=1, routing={"enabled": False}))
    store.add(users_deployment())
    before = copy.deepcopy(store.objects[("Deployment", "ns", "llama")])
    cluster = Cluster(Transport(store))  # type: ignore[arg-type]

    with pytest.raises(NotOwned):
        await reconcile(cluster, "ns", "llama", HeaderCache())
    assert store.objects[("Deployment", "ns", "llama")] == before  # untouched
    status = store.objects[("InferenceDeployment", "ns", "llama")]["status"]
    stalled = next(c for c in status["conditions"] if c["type"] == "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "NameInUse")
    assert stalled["message"] == (
        "Deployment llama exists and is not this InferenceDeployment's (it has no controller); "
        "it is left as it is: delete or rename it, or rename the InferenceDeployment"
    )
    assert "NameInUse" in store.events

    del store.objects[("Deployment", "ns", "llama")]  # the user renames theirs
    await reconcile(cluster, "ns", "llama", HeaderCache())
    ours = store.objects[("Deployment", "ns", "llama")]
    assert ours["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    ready = next(c for c in store.objects[("InferenceDeployment", "ns", "llama")]["status"]
                 ["conditions"] if c["type"] == "Stalled")  # fmt: skip
    assert ready["reason"] != "NameInUse"


async def test_an_object_another_controller_owns_is_not_adopted_but_a_predecessors_is() -> None:
    store = MemoryCluster()
    store.add(infd(replicas=1, routing={"enabled": False}))
    others = users_deployment()
    others["metadata"]["ownerReferences"] = [
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": "llama", "uid": "r-9",
         "controller": True},
    ]  # fmt: skip
    store.add(others)
    cluster = Cluster(Transport(store))  # type: ignore[arg-type]
    with pytest.raises(NotOwned, match=r"\(controlled by Rollout llama\)"):
        await reconcile(cluster, "ns", "llama", HeaderCache())

    # An earlier InferenceDeployment of the same name (deleted; its uid is another): what it
    # left is the new one's to take over, as before.
    left = users_deployment()
    left["metadata"]["ownerReferences"] = [
        {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment", "name": "llama",
         "uid": "u-0", "controller": True},
    ]  # fmt: skip
    store.objects[("Deployment", "ns", "llama")] = left
    await reconcile(cluster, "ns", "llama", HeaderCache())
    ours = store.objects[("Deployment", "ns", "llama")]
    assert [ref["uid"] for ref in ours["metadata"]["ownerReferences"]] == ["u-1"]


async def test_a_child_checked_once_is_applied_without_a_read_each_pass() -> None:
    """The ownership check reads a child once per OWNER_CHECK_SECONDS, not on every pass."""
    store = MemoryCluster()
    store.add(infd(replicas=1, routing={"enabled": False}))
    transport = Transport(store)
    reads: list[str] = []
    answer = transport.call_api

    async def counting(path: str, method: str, **options: Any) -> Any:
        if method == "GET" and path.endswith("/services/llama"):
            reads.append(path)
        return await answer(path, method, **options)

    transport.call_api = counting  # type: ignore[method-assign]
    cluster = Cluster(transport)  # type: ignore[arg-type]
    for _ in range(3):
        await reconcile(cluster, "ns", "llama", HeaderCache())
    assert len(reads) == 1, json.dumps(reads)


async def test_the_ownership_check_is_made_again_after_owner_check_seconds(monkeypatch) -> None:
    """A child deleted by hand and made again by someone else is found within
    OWNER_CHECK_SECONDS, however often the child is applied meanwhile."""
    now = [1000.0]
    monkeypatch.setattr(apply.time, "monotonic", lambda: now[0])
    store = MemoryCluster()
    store.add(infd(replicas=1, routing={"enabled": False}))
    cluster = Cluster(Transport(store))  # type: ignore[arg-type]
    for _ in range(3):
        await reconcile(cluster, "ns", "llama", HeaderCache())
        now[0] += apply.OWNER_CHECK_SECONDS / 3
    store.objects[("Deployment", "ns", "llama")] = users_deployment()
    now[0] += 1
    with pytest.raises(NotOwned):
        await reconcile(cluster, "ns", "llama", HeaderCache())


async def test_a_foreign_object_among_the_children_stops_the_pass_before_any_apply() -> None:
    """Someone else's NetworkPolicy of the name (the last child): before, the Deployment,
    Service and PodDisruptionBudget were applied first, on every retry, leaving a half-applied
    InferenceDeployment; now nothing is applied until the name is free."""
    store = MemoryCluster()
    store.add(infd(replicas=1, routing={"enabled": False}))
    store.add({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
               "metadata": {"name": "llama", "namespace": "ns"}, "spec": {}})  # fmt: skip
    cluster = Cluster(Transport(store))  # type: ignore[arg-type]
    with pytest.raises(NotOwned, match="NetworkPolicy llama exists"):
        await reconcile(cluster, "ns", "llama", HeaderCache())
    assert sorted(kind for kind, _, _ in store.objects) == ["InferenceDeployment", "NetworkPolicy"]
