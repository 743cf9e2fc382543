"""Leader election among operator replicas: one Lease, resourceVersion-conditional writes, a
standby that takes over only once the leader's record stood still for the lease's duration
(as the standby's own clock saw it), and a leader that releases the Lease when it shuts down."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from kvfleet_operator import leadership
from kvfleet_operator.leadership import LEASE_NAME, Leadership, claim
from kvfleet_operator.metrics import REGISTRY

NOW = datetime(2026, 12, 6, 19, 0, tzinfo=UTC)


def test_a_free_or_own_lease_is_claimed_and_anothers_only_once_it_ran_out() -> None:
    first = claim(None, "a", NOW, expired=False)
    assert first is not None
    assert (first["holderIdentity"], first["leaseTransitions"]) == ("a", 1)
    assert first["renewTime"] == "2026-12-06T19:00:00.000000Z"
    renewed = claim(first, "a", NOW.replace(second=2), expired=False)
    assert renewed is not None
    assert renewed["acquireTime"] == first["acquireTime"]  # the same term
    assert renewed["leaseTransitions"] == 1
    assert claim(renewed, "b", NOW, expired=False) is None  # a's, running
    taken = claim(renewed, "b", NOW.replace(second=30), expired=True)
    assert taken is not None
    assert (taken["holderIdentity"], taken["leaseTransitions"]) == ("b", 2)
    released = {**renewed, "holderIdentity": None}
    assert claim(released, "b", NOW, expired=False) is not None  # given up: at once


class LeaseStore:
    """One Lease in a fake API server: writes conditional on resourceVersion, as the real one."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False

    async def get(self, api_version: str, kind: str, name: str, namespace: str):
        assert (kind, name, namespace) == ("Lease", LEASE_NAME, "kvfleet-system")
        self._reachable()
        return copy.deepcopy(self.lease)

    async def post(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self._reachable()
        if self.lease is not None:
            raise ApiException(status=409, reason="Conflict")
        return self._store(manifest)

    async def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self._reachable()
        assert self.lease is not None
        if manifest["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        return self._store(manifest)

    def _store(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = copy.deepcopy(manifest)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)

    def _reachable(self) -> None:
        if self.down:
            raise ApiException(status=503, reason="Service Unavailable")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(leadership.time, "monotonic", clock.monotonic)
    return clock


async def leader_and_standby(store: LeaseStore) -> tuple[Leadership, Leadership]:
    """Two replicas on one Lease, `a` first: a leads, b waits."""
    a = Leadership(store, "kvfleet-system", "operator-a")  # type: ignore[arg-type]
    b = Leadership(store, "kvfleet-system", "operator-b")  # type: ignore[arg-type]
    await a._round()
    await b._round()
    assert (a.leading, b.leading) == (True, False) and a.acquired.is_set()
    return a, b


async def test_one_replica_leads_and_the_other_takes_over_when_it_stops_renewing(clock) -> None:
    store = LeaseStore()
    a, b = await leader_and_standby(store)
    for _ in range(10):  # a renews every 2 s: b never sees its record stand still
        clock.now += 2
        await a._round()
        await b._round()
    assert (a.leading, b.leading) == (True, False)
    # a stops renewing (its pod was killed): b waits out the lease from when it last saw a
    # change, by its own clock, then takes the Lease.
    clock.now += 2
    await b._round()
    clock.now += leadership.LEASE_SECONDS - 2
    await b._round()
    assert not b.leading
    clock.now += 3
    await b._round()
    assert b.leading and store.lease is not None
    assert store.lease["spec"]["holderIdentity"] == "operator-b"
    assert store.lease["spec"]["leaseTransitions"] == 2


async def test_a_leader_that_cannot_renew_stops_leading_and_says_why(clock, monkeypatch) -> None:
    store = LeaseStore()
    a = Leadership(store, "kvfleet-system", "operator-a")  # type: ignore[arg-type]
    assert REGISTRY.get_sample_value("kvfleet_operator_leading") == 0
    await a._round()
    assert a.leading
    assert REGISTRY.get_sample_value("kvfleet_operator_leading") == 1  # for "no leader" alerts
    store.down = True
    lost: list[str] = []

    async def no_sleep(_: float) -> None:
        clock.now += leadership.RENEW_SECONDS

    monkeypatch.setattr(leadership.asyncio, "sleep", no_sleep)  # the renewals' waits pass
    await a.run(lost.append)
    assert not a.leading and REGISTRY.get_sample_value("kvfleet_operator_leading") == 0
    assert lost == ["could not renew the Lease kvfleet-system/kvfleet-operator for 10 s"]


async def test_a_leader_shutting_down_releases_the_lease_for_the_standby(clock) -> None:
    a, b = await leader_and_standby(LeaseStore())
    await a.release()
    assert not a.leading
    await b._round()  # at once: no lease duration to wait out
    assert b.leading


def test_leader_election_without_a_namespace_for_the_lease_is_refused(monkeypatch, capsys) -> None:
    from kvfleet_operator.main import main

    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--leader-election"])
    assert exit_.value.code == 2
    assert "--leader-election: set $POD_NAMESPACE" in capsys.readouterr().err
