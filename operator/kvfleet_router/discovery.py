"""Who the replicas are: the ready endpoints of the engine Service's EndpointSlices (a list,
then a watch; relisted when the watch ends or fails), or a fixed list of URLs.

Either way the result goes into `ReplicaPool.set_members`; `synced` says the first full list
has arrived (the router reports ready from then on, with or without replicas: at zero it holds
requests).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from kvfleet_router.replicas import ReplicaPool
from kvfleet_router.settings import ENGINE_PORT

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PORT_NAME = "http"
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; then list again
RETRY_S = 2.0  # after a failed list or watch


def ready_addresses(slices: Iterable[dict[str, Any]]) -> set[str]:
    """host:port of every ready, not terminating endpoint in the EndpointSlices (dicts as the
    API returns them). An absent `ready` means ready (the API's rule)."""
    addresses = set()
    for endpoint_slice in slices:
        ports = endpoint_slice.get("ports") or []
        port = next((p.get("port") for p in ports if p.get("name") == PORT_NAME), None)
        if port is None:
            port = ports[0].get("port") if len(ports) == 1 else ENGINE_PORT
        for endpoint in endpoint_slice.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            for ip in endpoint.get("addresses") or []:
                addresses.add(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return addresses


def backend_address(url: str) -> str:
    """http://host:port -> host:port (port 80 when absent)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port or 80}"


class StaticDiscovery:
    """Fixed backends; each becomes available at its first successful scrape."""

    def __init__(self, pool: ReplicaPool, backends: Iterable[str]) -> None:
        self._pool = pool
        self._addresses = [backend_address(url) for url in backends]
        self.synced = False

    async def run(self) -> None:
        self._pool.set_members(self._addresses, reachable=False)
        self.synced = True


class EndpointSliceDiscovery:
    """The ready endpoints of Service `service` in `namespace`, kept current by a watch."""

    def __init__(self, pool: ReplicaPool, namespace: str, service: str) -> None:
        self._pool = pool
        self._namespace = namespace
        self._selector = f"{SERVICE_NAME_LABEL}={service}"
        self._slices: dict[str, dict[str, Any]] = {}  # slice name -> slice
        self.synced = False

    async def run(self) -> None:
        from kubernetes_asyncio import client, config, watch

        try:
            config.load_incluster_config()
        except config.ConfigException:
            await config.load_kube_config()
        async with client.ApiClient() as api_client:
            discovery = client.DiscoveryV1Api(api_client)
            while True:
                try:
                    version = await self._list(discovery)
                    await self._watch(discovery, watch.Watch(), version)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("EndpointSlices of %s: %s; retrying", self._selector, exc)
                    await asyncio.sleep(RETRY_S)

    async def _list(self, discovery: Any) -> str:
        response = await discovery.list_namespaced_endpoint_slice(
            self._namespace, label_selector=self._selector, _preload_content=False
        )
        listing = json.loads(await response.read())
        self._slices = {item["metadata"]["name"]: item for item in listing.get("items", [])}
        self._publish()
        self.synced = True
        version: str = listing["metadata"]["resourceVersion"]
        return version

    async def _watch(self, discovery: Any, watcher: Any, version: str) -> None:
        async with watcher.stream(
            discovery.list_namespaced_endpoint_slice,
            self._namespace,
            label_selector=self._selector,
            resource_version=version,
            timeout_seconds=WATCH_TIMEOUT_S,
        ) as events:
            async for event in events:
                kind, raw = event["type"], event["raw_object"]
                if kind == "ERROR":
                    log.info("EndpointSlice watch ended: %s", raw.get("message", raw))
                    return
                name = raw["metadata"]["name"]
                if kind == "DELETED":
                    self._slices.pop(name, None)
                else:
                    self._slices[name] = raw
                self._publish()

    def _publish(self) -> None:
        addresses = ready_addresses(self._slices.values())
        if addresses != set(self._pool.members):
            log.info("replicas of %s: %s", self._selector, ", ".join(sorted(addresses)) or "none")
        self._pool.set_members(addresses, reachable=True)
