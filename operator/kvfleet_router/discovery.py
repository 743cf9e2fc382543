"""Who the replicas are: the ready endpoints of the engine Service's EndpointSlices (a list,
then a watch; relisted when the watch ends or fails; or the ready pods its selector matches),
or a fixed list of URLs.

Either way the result, address -> pod name (a static URL's name is its host:port), goes into
`ReplicaPool.set_members`; `synced` says the first full list has arrived (the router reports
ready from then on, with or without replicas: at zero it holds requests).
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
DEPLOYMENT_LABEL = "kvfleet.io/deployment"  # the engine pods' (and their Service's) selector
DISCOVERY_SOURCES = ("endpointslices", "pods")
PORT_NAME = "http"
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; then list again
# The client gives up on a list, and on a watch this long past WATCH_TIMEOUT_S: an API server
# that fell silent (a half-open connection) held discovery on its last view for ever.
LIST_TIMEOUT_S = 30.0
WATCH_GRACE_S = 30.0
RETRY_S = 2.0  # after a failed list or watch
MAX_NAMES_LOGGED = 10  # replicas named in a log line of a change, each way


def ready_endpoints(slices: Iterable[dict[str, Any]]) -> dict[str, str]:
    """host:port -> pod name of every ready, not terminating endpoint in the EndpointSlices
    (dicts as the API returns them; an endpoint without a pod targetRef is named by its
    host:port). An absent `ready` means ready (the API's rule).

    One replica per pod: an endpoint's several addresses are one endpoint (the API's rule),
    and a pod in several slices (one per address family on a dual-stack Service, or two while
    the controller moves it) keeps its lowest address. Before, each was a replica of its own,
    and the pod got twice its share of the traffic."""
    addresses: dict[str, str] = {}  # pod name (or address) -> its address
    for endpoint_slice in slices:
        port = _slice_port(endpoint_slice.get("ports") or [])
        for endpoint in endpoint_slice.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            ips = endpoint.get("addresses") or []
            if not ips or not isinstance(ips[0], str):
                continue
            address = f"[{ips[0]}]:{port}" if ":" in ips[0] else f"{ips[0]}:{port}"
            target = endpoint.get("targetRef") or {}
            pod = (target.get("name") if target.get("kind") == "Pod" else None) or address
            if pod not in addresses or address < addresses[pod]:
                addresses[pod] = address
    return {address: pod for pod, address in addresses.items()}


def _slice_port(ports: list[dict[str, Any]]) -> int:
    """The engine's port in a slice: the one named http, else its only port, else 8000 (a
    port without a number, which the API allows, made the address "10.0.0.1:None")."""
    named = [p.get("port") for p in ports if p.get("name") == PORT_NAME]
    numbers = named or ([p.get("port") for p in ports] if len(ports) == 1 else [])
    port = numbers[0] if numbers else None
    return port if isinstance(port, int) and 0 < port < 65536 else ENGINE_PORT


def ready_pod_endpoints(pods: Iterable[dict[str, Any]]) -> dict[str, str]:
    """podIP:8000 -> pod name of every Running, Ready pod that is not terminating."""
    endpoints = {}
    for pod in pods:
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if not ip or pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        if conditions.get("Ready") == "True":
            address = f"[{ip}]:{ENGINE_PORT}" if ":" in ip else f"{ip}:{ENGINE_PORT}"
            endpoints[address] = pod["metadata"]["name"]
    return endpoints


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
        self._pool.set_members({a: a for a in self._addresses}, reachable=False)
        self.synced = True


class KubernetesDiscovery:
    """The ready replicas behind the engine Service `service` in `namespace`, kept current by
    a list and a watch: of its EndpointSlices (`source="endpointslices"`, what the operator
    renders), or of the pods its selector matches (`source="pods"`; for clusters whose
    EndpointSlices cannot hold the pod IPs, such as the e2e control plane, where kwok's pod IPs
    are loopback addresses the API server refuses in an EndpointSlice)."""

    def __init__(
        self, pool: ReplicaPool, namespace: str, service: str, source: str = "endpointslices"
    ) -> None:
        if source not in DISCOVERY_SOURCES:
            raise ValueError(f"source: must be one of {', '.join(DISCOVERY_SOURCES)}")
        self._pool = pool
        self._namespace = namespace
        self._source = source
        label = SERVICE_NAME_LABEL if source == "endpointslices" else DEPLOYMENT_LABEL
        self._selector = f"{label}={service}"
        self._objects: dict[str, dict[str, Any]] = {}  # name -> EndpointSlice or Pod
        self.synced = False

    async def run(self) -> None:
        from kubernetes_asyncio import client, config, watch

        try:
            config.load_incluster_config()
        except config.ConfigException:
            await config.load_kube_config()
        async with client.ApiClient() as api_client:
            list_func: Any  # the list call of EndpointSlices or of Pods, watched alike
            if self._source == "endpointslices":
                list_func = client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice
            else:
                list_func = client.CoreV1Api(api_client).list_namespaced_pod
            while True:
                try:
                    version = await self._list(list_func)
                    await self._watch(list_func, watch.Watch(), version)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("%s of %s: %s; retrying", self._source, self._selector, exc)
                    await asyncio.sleep(RETRY_S)

    async def _list(self, list_func: Any) -> str:
        response = await list_func(
            self._namespace,
            label_selector=self._selector,
            _preload_content=False,
            _request_timeout=LIST_TIMEOUT_S,
        )
        listing = json.loads(await response.read())
        self._objects = {item["metadata"]["name"]: item for item in listing.get("items", [])}
        self._publish()
        self.synced = True
        version: str = listing["metadata"]["resourceVersion"]
        return version

    async def _watch(self, list_func: Any, watcher: Any, version: str) -> None:
        """Follow changes until the watch ends; a 410 Gone (the version is too old, as after
        the API server compacted its history) ends it too, to list again at once."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            await self._follow(list_func, watcher, version)
        except ApiException as exc:
            if exc.status != 410:
                raise
            log.info(
                "%s watch of %s expired (410 Gone): listing again", self._source, self._selector
            )

    async def _follow(self, list_func: Any, watcher: Any, version: str) -> None:
        async with watcher.stream(
            list_func,
            self._namespace,
            label_selector=self._selector,
            resource_version=version,
            timeout_seconds=WATCH_TIMEOUT_S,
            _request_timeout=WATCH_TIMEOUT_S + WATCH_GRACE_S,
        ) as events:
            async for event in events:
                kind, raw = event["type"], event["raw_object"]
                name = raw["metadata"]["name"]
                if kind == "DELETED":
                    self._objects.pop(name, None)
                else:
                    self._objects[name] = raw
                self._publish()

    def _publish(self) -> None:
        objects = self._objects.values()
        if self._source == "endpointslices":
            endpoints = ready_endpoints(objects)
        else:
            endpoints = ready_pod_endpoints(objects)
        members = {a: r.name for a, r in self._pool.members.items()}
        if endpoints != members or not self.synced:  # the first list is logged, even empty
            log.info("replicas of %s: %s", self._selector, describe_change(members, endpoints))
            self._pool.set_members(endpoints, reachable=True)


def describe_change(old: dict[str, str], new: dict[str, str]) -> str:
    """What a log line says of a change of replicas (address -> pod name): up to
    MAX_NAMES_LOGGED of them, the list; past that how many there are and which came and went,
    at most MAX_NAMES_LOGGED of each (the whole list, on every change, was 80 KB a line at
    2,000 endpoints)."""
    if len(new) <= MAX_NAMES_LOGGED:
        return ", ".join(f"{name} ({a})" for a, name in sorted(new.items())) or "none"
    added = sorted(f"{name} ({a})" for a, name in new.items() if old.get(a) != name)
    removed = sorted(f"{name} ({a})" for a, name in old.items() if new.get(a) != name)
    parts = [f"{len(new)} ready"]
    for sign, names in (("+", added), ("-", removed)):
        if names:
            more = len(names) - MAX_NAMES_LOGGED
            shown = ", ".join(names[:MAX_NAMES_LOGGED]) + (f" and {more} more" if more > 0 else "")
            parts.append(f"{sign}{len(names)}: {shown}")
    return "; ".join(parts)
