"""Leader election among operator replicas (`kvfleet operator --leader-election`), on a
coordination.k8s.io Lease as client-go's leaderelection does it: the leader renews the Lease
every RENEW_SECONDS; another replica takes it over once its record has stood unchanged for
LEASE_SECONDS as this replica observed it (its own clock only: no trust in other nodes' clocks);
a leader that cannot renew for RENEW_DEADLINE_SECONDS stops leading, and the process ends (the
pod restarts as a standby), so two replicas never act at once for longer than that. A leader
that shuts down releases the Lease, so the standby takes over at once in a rolling update.

Only the leader reconciles and autoscales; a standby's kopf handlers return at once (the
leader's resync, every 15 s, covers whatever a standby saw first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kvfleet_operator import metrics
from kvfleet_operator.apply import Cluster, api_error_summary, conflicted

log = logging.getLogger(__name__)

LEASE = ("coordination.k8s.io/v1", "Lease")
LEASE_NAME = "kvfleet-operator"  # the default; a second install beside another names its own
LEASE_SECONDS = 15
RENEW_SECONDS = 2.0  # how often the leader renews, and a standby looks
RENEW_DEADLINE_SECONDS = 10.0  # the leader stops leading after this long without a renewal


def claim(
    record: dict[str, Any] | None, identity: str, now: datetime, expired: bool
) -> dict[str, Any] | None:
    """The Lease spec with which `identity` leads from `now`, or None while another holder's
    record runs (`expired`: it stood unchanged for its duration as this replica saw it)."""
    record = record or {}
    holder = record.get("holderIdentity") or None
    if holder not in (None, identity) and not expired:
        return None
    stamp = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    ours = holder == identity
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": LEASE_SECONDS,
        "acquireTime": record.get("acquireTime", stamp) if ours else stamp,
        "renewTime": stamp,
        "leaseTransitions": int(record.get("leaseTransitions") or 0) + (0 if ours else 1),
    }


class Leadership:
    """Campaigns for the Lease `name` in `namespace` as `identity`; `leading` says whether this
    replica leads now, `acquired` is set once it first does."""

    def __init__(
        self, cluster: Cluster, namespace: str, identity: str, name: str = LEASE_NAME
    ) -> None:
        self.cluster, self.namespace, self.identity = cluster, namespace, identity
        self.name = name
        self._leading = False
        metrics.LEADING.set(0)
        self.acquired = asyncio.Event()
        self._seen: dict[str, Any] | None = None  # the record as last read, and when it changed
        self._seen_at = 0.0
        self._renewed_at = 0.0
        self._lease: dict[str, Any] | None = None

    @property
    def leading(self) -> bool:
        return self._leading

    @leading.setter
    def leading(self, value: bool) -> None:
        self._leading = value
        metrics.LEADING.set(1 if value else 0)  # kvfleet_operator_leading

    async def run(self, on_lost: Callable[[str], None]) -> None:
        """Campaign, then renew, until cancelled; `on_lost(reason)` when leadership is lost."""
        while True:
            try:  # a renewal that hangs ends in time for the deadline, as client-go's does
                async with asyncio.timeout(self._round_seconds()):
                    await self._round()
            except TimeoutError:
                log.warning("the Lease %s/%s: the API server did not answer in time",
                            self.namespace, self.name)  # fmt: skip
            if self.leading and time.monotonic() - self._renewed_at > RENEW_DEADLINE_SECONDS:
                self.leading = False
                on_lost(f"could not renew the Lease {self.namespace}/{self.name} for "
                        f"{RENEW_DEADLINE_SECONDS:.0f} s")  # fmt: skip
                return
            await asyncio.sleep(RENEW_SECONDS)

    def _round_seconds(self) -> float:
        """How long one round may take: a leader's, until its renew deadline (it must stop
        leading then, not whenever an unanswered request gives up); a standby's, the deadline."""
        if not self.leading:
            return RENEW_DEADLINE_SECONDS
        left = RENEW_DEADLINE_SECONDS - (time.monotonic() - self._renewed_at)
        return max(left, 0.0) + 0.01

    async def _round(self) -> None:
        try:
            lease = await self.cluster.get(*LEASE, self.name, self.namespace)
            record = (lease or {}).get("spec") or {}
            now = time.monotonic()
            if record != self._seen:
                self._seen, self._seen_at = record, now
            duration = float(record.get("leaseDurationSeconds") or LEASE_SECONDS)
            spec = claim(record, self.identity, datetime.now(UTC), now - self._seen_at > duration)
            if spec is None:
                if self.leading:
                    log.error("another operator replica holds the Lease now: %s", record)
                    self._renewed_at = 0.0  # lost: run() ends leadership
                return
            self._lease = await self._write(lease, spec)
            self._renewed_at = time.monotonic()
            if not self.leading:
                log.info("leading: this replica (%s) holds the Lease %s/%s",
                         self.identity, self.namespace, self.name)  # fmt: skip
            self.leading = True
            self.acquired.set()
        except Exception as exc:  # API errors, a conflict with another replica's write
            level = logging.DEBUG if conflicted(exc) else logging.WARNING
            log.log(level, "the Lease %s/%s: %s", self.namespace, self.name,
                    api_error_summary(exc))  # fmt: skip

    async def _write(self, lease: dict[str, Any] | None, spec: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if lease is None:
            return await self.cluster.post({**_lease_kind(), "metadata": meta, "spec": spec})
        meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
        return await self.cluster.replace({**_lease_kind(), "metadata": meta, "spec": spec})

    async def release(self) -> None:
        """Give the Lease up (shutting down): the standby need not wait for it to run out."""
        if not self.leading or self._lease is None:
            return
        self.leading = False
        spec = {**self._lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1}
        try:
            await self._write(self._lease, spec)
            log.info("released the Lease %s/%s", self.namespace, self.name)
        except Exception as exc:  # it runs out by itself
            log.warning("could not release the Lease: %s", api_error_summary(exc))


def _lease_kind() -> dict[str, str]:
    return {"apiVersion": LEASE[0], "kind": LEASE[1]}
