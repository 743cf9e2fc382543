"""The one module that talks to the Kubernetes API server.

Every write of a child object goes through `Cluster.apply`: server-side apply under one field
manager, with the owner's controller reference, forced (the operator owns what it renders). The
autoscaler writes the child workload's replicas through `Cluster.scale` under its own manager.
Reads return plain dicts; a missing object is `None`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from kvfleet_operator import api

log = logging.getLogger(__name__)

Manifest = dict[str, Any]

# (apiVersion, kind) -> (plural, namespaced): the kinds the operator reads or writes.
RESOURCES: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "Pod"): ("pods", True),
    ("v1", "Service"): ("services", True),
    ("v1", "Event"): ("events", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("rbac.authorization.k8s.io/v1", "Role"): ("roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("apps/v1", "StatefulSet"): ("statefulsets", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("servicemonitors", True),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): ("leaderworkersets", True),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): ("horizontalpodautoscalers", True),
    ("keda.sh/v1alpha1", "ScaledObject"): ("scaledobjects", True),
    ("coordination.k8s.io/v1", "Lease"): ("leases", True),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): ("customresourcedefinitions", False),
    (api.API_VERSION, api.INFERENCE_DEPLOYMENT): (api.INFERENCE_DEPLOYMENTS, True),
    (api.API_VERSION, api.ACCELERATOR_PROFILE): (api.ACCELERATOR_PROFILES, False),
}
CRD_CACHE_SECONDS = 30.0
# 429 (the API server's storage for a just-installed CRD is initializing, or priority and
# fairness throttles us): retried in place after Retry-After, capped, a few times.
RETRY_STATUSES = frozenset({429})
MAX_RETRIES = 5
MAX_RETRY_AFTER_SECONDS = 10.0
# A request the API server does not answer in this time fails (TimeoutError). Without it a
# connection that hangs (a black-holed network, a half-open socket after a control-plane node
# died) blocked its caller for good: kubernetes_asyncio sets no timeout of its own.
REQUEST_TIMEOUT_SECONDS = 30.0
# A child is read before the first apply of this process (and again after this long) to see
# that it is not someone else's object of the same name; in between, applies trust the check.
OWNER_CHECK_SECONDS = 300.0
# Checks remembered before the stale ones are dropped.
MAX_OWNER_CHECKS = 4096


class NotOwned(Exception):
    """An object of a child's name exists and another owner (or none) controls it: applying
    would adopt it (and the garbage collector would delete it with the InferenceDeployment)."""


class Cluster:
    """A connection to the API server; create with `await Cluster.connect()`."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._client = api_client
        self._crds: dict[str, tuple[float, bool]] = {}
        self._served: dict[tuple[str, str], tuple[float, bool]] = {}
        # (apiVersion, kind, namespace, name) -> (owner uid, when) of children checked ours
        self._checked: dict[tuple[str, str, str, str], tuple[str, float]] = {}

    @classmethod
    async def connect(cls) -> Cluster:
        """In-cluster service account when running in a pod, else $KUBECONFIG / ~/.kube/config."""
        try:
            config.load_incluster_config()
        except config.ConfigException:
            await config.load_kube_config()
        return cls(client.ApiClient())

    async def close(self) -> None:
        await self._client.close()

    # -- reads ------------------------------------------------------------------------------

    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> Manifest | None:
        return await self._request("GET", _path(api_version, kind, namespace, name))

    async def list(
        self, api_version: str, kind: str, namespace: str | None = None, selector: str = ""
    ) -> list[Manifest]:
        query = {"labelSelector": selector} if selector else None
        found = await self._request("GET", _path(api_version, kind, namespace), query=query)
        return found["items"] if found else []

    async def has_crd(self, name: str) -> bool:
        """Whether a CRD is installed (cached for CRD_CACHE_SECONDS)."""
        now = time.monotonic()
        cached = self._crds.get(name)
        if cached and now - cached[0] < CRD_CACHE_SECONDS:
            return cached[1]
        present = (
            await self.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", name) is not None
        )
        self._crds[name] = (now, present)
        return present

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in `api_version`, by its discovery document
        (an installed CRD is served once Established); cached for CRD_CACHE_SECONDS."""
        now = time.monotonic()
        cached = self._served.get((api_version, plural))
        if cached and now - cached[0] < CRD_CACHE_SECONDS:
            return cached[1]
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        found = await self._request("GET", prefix)
        present = any(r.get("name") == plural for r in (found or {}).get("resources", []))
        self._served[(api_version, plural)] = (now, present)
        return present

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret, decoded; None when the Secret or the key is missing or the
        operator may not read Secrets (a role narrower than the shipped one)."""
        try:
            secret = await self.get("v1", "Secret", name, namespace)
        except ApiException as exc:
            if exc.status != 403:
                raise
            log.info("may not read Secret %s/%s: %s", namespace, name, exc.reason)
            return None
        encoded = ((secret or {}).get("data") or {}).get(key)
        if encoded is None:
            return None
        try:
            return base64.b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            log.warning("Secret %s/%s: key %s is not base64 UTF-8 text", namespace, name, key)
            return None

    async def secret_digest(self, namespace: str, name: str, key: str) -> str | None:
        """A digest of one key of a Secret (salted with the Secret's uid, so the annotation
        that carries it says nothing about the value); None when the Secret or the key is
        missing or the operator may not read Secrets."""
        try:
            secret = await self.get("v1", "Secret", name, namespace)
        except ApiException as exc:
            if exc.status != 403:
                raise
            log.info("may not read Secret %s/%s: %s", namespace, name, exc.reason)
            return None
        return None if secret is None else secret_key_digest(secret, key)

    # -- writes -----------------------------------------------------------------------------

    async def apply(
        self,
        manifest: Manifest,
        *,
        owner: Manifest | None = None,
        field_manager: str = api.FIELD_MANAGER,
    ) -> Manifest:
        """Server-side apply `manifest` (with `owner` as its controller), forced. An unchanged
        manifest is a no-op on the server: the object's resourceVersion stays the same. With
        `owner`, NotOwned when an object of the name exists that `owner` does not control
        (`foreign_controller`): it is left as it is."""
        meta = manifest["metadata"]
        if owner is not None:
            await self.check_owned(manifest, owner)
            manifest = with_owner(manifest, owner)
        path = _path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        query = {"fieldManager": field_manager, "force": "true"}
        result = await self._request(
            "PATCH", path, body=manifest, query=query, content_type="application/apply-patch+yaml"
        )
        if result is None:  # 404: its namespace is gone, or its kind is no longer served
            raise RuntimeError(
                f"{manifest['kind']} {meta['name']}: not found (its namespace is gone, or its "
                "kind is not served)"
            )
        return result

    async def check_owned(self, manifest: Manifest, owner: Manifest) -> None:
        """NotOwned when an object of the child `manifest`'s name exists that `owner` does not
        control (`foreign_controller`). The object is read unless an earlier check for the
        same owner is younger than OWNER_CHECK_SECONDS."""
        meta, uid = manifest["metadata"], owner["metadata"]["uid"]
        key = (manifest["apiVersion"], manifest["kind"], meta.get("namespace") or "", meta["name"])
        now = time.monotonic()
        checked = self._checked.get(key)
        if checked and checked[0] == uid and now - checked[1] < OWNER_CHECK_SECONDS:
            return
        found = await self.get(key[0], key[1], key[3], key[2] or None)
        other = None if found is None else foreign_controller(found, owner)
        if other is not None:
            raise NotOwned(
                f"{key[1]} {key[3]} exists and is not this InferenceDeployment's ({other}); it "
                "is left as it is: delete or rename it, or rename the InferenceDeployment"
            )
        if len(self._checked) >= MAX_OWNER_CHECKS:  # children of deleted objects: forgotten
            self._checked = {
                k: v for k, v in self._checked.items() if now - v[1] < OWNER_CHECK_SECONDS
            }
        self._checked[key] = (uid, now)

    async def create(self, manifest: Manifest, *, owner: Manifest) -> bool:
        """Create `manifest` with `owner` as its controller; False when an object of its name
        exists already (409), which is left as it is. For what is made once and never
        rendered again (a random key), where `apply` would replace it on every pass."""
        try:
            await self.post(with_owner(manifest, owner))
        except ApiException as exc:
            if conflicted(exc):
                return False
            raise
        return True

    async def post(self, manifest: Manifest) -> Manifest:
        """Create `manifest` as it is, the object as created (409 Conflict, `conflicted`, when
        its name is taken: another writer was first)."""
        meta = manifest["metadata"]
        path = _path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"))
        result = await self._request("POST", path, body=manifest)
        assert result is not None
        return result

    async def replace(self, manifest: Manifest) -> Manifest:
        """Replace the object with `manifest`, conditional on its metadata.resourceVersion (409
        Conflict when another writer came between); the object as written."""
        meta = manifest["metadata"]
        path = _path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        result = await self._request("PUT", path, body=manifest)
        assert result is not None
        return result

    async def scale(
        self,
        namespace: str,
        name: str,
        replicas: int,
        *,
        field_manager: str = api.AUTOSCALER_FIELD_MANAGER,
        api_version: str = "apps/v1",
        kind: str = "Deployment",
    ) -> Manifest:
        """Set the replicas of the child workload `name` (a Deployment, or a LeaderWorkerSet
        whose replicas are groups), owning only that field."""
        manifest = {
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas},
        }
        return await self.apply(manifest, field_manager=field_manager)

    async def delete(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        propagation: str | None = None,
    ) -> bool:
        """Delete an object; False when it was not there. `propagation` "Foreground": the
        object stays (with a deletionTimestamp) until the garbage collector has deleted its
        dependents, so nothing of it is left when it is gone."""
        options = None if propagation is None else {"propagationPolicy": propagation}
        try:
            await self._request("DELETE", _path(api_version, kind, namespace, name), body=options)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def patch_status(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None,
        status: Manifest,
        *,
        resource_version: str | None = None,
    ) -> Manifest | None:
        """JSON-merge-patch the status subresource; keys set to None are removed. With
        `resource_version`, the API server refuses (409 Conflict) if the object changed since."""
        path = _path(api_version, kind, namespace, name) + "/status"
        body: Manifest = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self._request(
            "PATCH",
            path,
            body=body,
            content_type="application/merge-patch+json",
        )

    async def post_event(
        self, involved: Manifest, type_: str, reason: str, message: str, *, name: str | None = None
    ) -> None:
        """A core/v1 Event about `involved` (best effort: failures are logged, not raised).
        `name`: the event's own name, so that telling it twice (a pass that ends between the
        event and the status that records it, then runs again) makes one event, not two."""
        meta = involved["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        naming = {"name": name} if name is not None else {"generateName": f"{meta['name']}."}
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {**naming, "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved["apiVersion"],
                "kind": involved["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": api.FIELD_MANAGER},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self._request("POST", _path("v1", "Event", meta["namespace"]), body=event)
        except ApiException as exc:
            if exc.status == 409 and name is not None:
                return  # told already
            log.warning("could not post event %s on %s: %s", reason, meta["name"], exc.reason)

    # -- transport --------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Manifest | None = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Manifest | None:
        for attempt in range(MAX_RETRIES + 1):
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                    response = await self._client.call_api(
                        path,
                        method,
                        query_params=list((query or {}).items()),
                        header_params={"Accept": "application/json", "Content-Type": content_type},
                        body=body,
                        auth_settings=["BearerToken"],
                        response_types_map={200: "object", 201: "object"},
                        _return_http_data_only=True,
                    )
                break
            except TimeoutError:
                raise TimeoutError(
                    f"{method} {path}: no answer from the API server in "
                    f"{REQUEST_TIMEOUT_SECONDS:g} s"
                ) from None
            except ApiException as exc:
                if exc.status == 404 and method in ("GET", "PATCH"):
                    return None
                if exc.status not in RETRY_STATUSES or attempt == MAX_RETRIES:
                    raise
                delay = retry_after_seconds(exc)
                log.warning(
                    "%s %s: %s; retry %d of %d in %.0f s",
                    method,
                    path,
                    api_error_summary(exc),
                    attempt + 1,
                    MAX_RETRIES,
                    delay,
                )
                await asyncio.sleep(delay)
        decoded: Manifest = response
        return decoded


async def patch_status_as_read(
    cluster: Cluster, body: Manifest, status: dict[str, Any]
) -> dict[str, Any] | None:
    """Merge-patch the status of the InferenceDeployment `body`, conditional on the
    resourceVersion it was read at (409 Conflict, `conflicted`, when another writer came
    between); the object as written."""
    meta = body["metadata"]
    return await cluster.patch_status(
        api.API_VERSION,
        api.INFERENCE_DEPLOYMENT,
        meta["name"],
        meta["namespace"],
        status,
        resource_version=meta.get("resourceVersion"),
    )


async def read_again(cluster: Cluster, body: Manifest) -> dict[str, Any] | None:
    """The InferenceDeployment `body` as the API server has it now; None when it is gone:
    deleted, or deleted and created anew under its name (another uid: what was decided on the
    old one's spec is not the new one's to get)."""
    meta = body["metadata"]
    fresh = await cluster.get(
        api.API_VERSION, api.INFERENCE_DEPLOYMENT, meta["name"], meta["namespace"]
    )
    if fresh is None or fresh["metadata"].get("uid") != meta.get("uid"):
        return None
    return fresh


def refused(exc: BaseException) -> bool:
    """Whether the API server refused a request in a way a retry of the same object cannot
    change: bad request, forbidden, invalid (what a webhook's denial also is)."""
    return isinstance(exc, ApiException) and exc.status in (400, 403, 422)


def conflicted(exc: BaseException) -> bool:
    """Whether a write conditional on a resourceVersion (or a uid) was refused because the
    object changed (or was replaced, or is gone) since it was read: 409 Conflict."""
    return isinstance(exc, ApiException) and exc.status == 409


def api_error_summary(exc: BaseException) -> str:
    """One line for an API error: "429 Too Many Requests: storage is (re)initializing", not the
    exception's text (every response header and the whole body)."""
    if not isinstance(exc, ApiException):
        return f"{type(exc).__name__}: {exc}"
    message = ""
    try:
        message = json.loads(exc.body or "{}").get("message", "")
    except (ValueError, AttributeError):
        message = str(exc.body or "")[:200]
    line = f"{exc.status} {exc.reason}"
    return f"{line}: {message}" if message else line


def retry_after_seconds(exc: ApiException) -> float:
    """The error's Retry-After (1 s when absent), at most MAX_RETRY_AFTER_SECONDS."""
    headers: dict[str, str] = dict(exc.headers or {})
    value = headers.get("Retry-After", "1")
    try:
        seconds = float(value)
    except ValueError:
        seconds = 1.0
    return max(0.0, min(seconds, MAX_RETRY_AFTER_SECONDS))


def _path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    plural, namespaced = RESOURCES[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespaced and namespace:
        prefix += f"/namespaces/{quote(namespace, safe='')}"
    path = f"{prefix}/{plural}"
    if not name:
        return path
    # One path segment ("/" escaped, "." and ".." refused): a name never reaches another
    # namespace's objects, whatever a spec put in it.
    if name in (".", ".."):
        raise ValueError(f"{name!r} is not an object name")
    return f"{path}/{quote(name, safe='')}"


def secret_key_digest(secret: Manifest, key: str) -> str | None:
    """sha256 of the Secret's uid, the key and its (base64) value, 32 hex digits; None when the
    key is absent. The uid salts it: the same key in another Secret digests differently."""
    encoded = (secret.get("data") or {}).get(key)
    if encoded is None:
        return None
    digest = hashlib.sha256(f"{secret['metadata'].get('uid', '')}/{key}/{encoded}".encode())
    return digest.hexdigest()[:32]


def foreign_controller(found: Manifest, owner: Manifest) -> str | None:
    """Who controls `found` when `owner` (an InferenceDeployment) does not and must not take
    it over, in words; None when it may be applied: controlled by `owner`, or by an earlier
    InferenceDeployment of the same name (deleted: the garbage collector is removing what it
    left, and the apply takes it over)."""
    owners = (found.get("metadata") or {}).get("ownerReferences") or []
    controller = next((ref for ref in owners if ref.get("controller")), None)
    if controller is None:
        return "it has no controller" if not owners else "it has no controller among its owners"
    if controller.get("uid") == owner["metadata"]["uid"]:
        return None
    group = str(controller.get("apiVersion", "")).split("/")[0]
    same_kind = (group, controller.get("kind")) == (
        owner["apiVersion"].split("/")[0],
        owner["kind"],
    )
    if same_kind and controller.get("name") == owner["metadata"]["name"]:
        return None
    return f"controlled by {controller.get('kind')} {controller.get('name')}"


def with_owner(manifest: Manifest, owner: Manifest) -> Manifest:
    """A copy of `manifest` with `owner` as its controlling owner reference."""
    meta = owner["metadata"]
    reference = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {**manifest, "metadata": {**manifest["metadata"], "ownerReferences": [reference]}}
