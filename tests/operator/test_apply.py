"""The apply layer: resource paths, owner references, and how API errors are retried and logged."""

from __future__ import annotations

import json
import logging

import pytest

from kvfleet_operator.apply import _path, with_owner


def test_paths_for_core_grouped_custom_and_cluster_scoped_kinds() -> None:
    assert _path("v1", "Pod", "ns") == "/api/v1/namespaces/ns/pods"
    assert _path("apps/v1", "Deployment", "ns", "x") == "/apis/apps/v1/namespaces/ns/deployments/x"
    assert (
        _path("kvfleet.io/v1alpha1", "InferenceDeployment", "ns", "x")
        == "/apis/kvfleet.io/v1alpha1/namespaces/ns/inferencedeployments/x"
    )
    assert (
        _path("kvfleet.io/v1alpha1", "AcceleratorProfile", None)
        == "/apis/kvfleet.io/v1alpha1/acceleratorprofiles"
    )
    assert _path("v1", "Pod", None) == "/api/v1/pods"  # all namespaces


def test_a_name_stays_one_path_segment_of_its_own_namespace() -> None:
    # A spec's Secret name never reaches another namespace's objects, whatever it holds.
    assert _path("v1", "Secret", "team-a", "../../kube-system/secrets/hf-token") == (
        "/api/v1/namespaces/team-a/secrets/..%2F..%2Fkube-system%2Fsecrets%2Fhf-token"
    )
    assert _path("v1", "Secret", "a/b", "x?y") == "/api/v1/namespaces/a%2Fb/secrets/x%3Fy"
    for name in (".", ".."):
        with pytest.raises(ValueError, match="is not an object name"):
            _path("v1", "Secret", "team-a", name)


def test_with_owner_sets_a_controller_reference_without_mutating() -> None:
    child = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "labels": {}}}
    owner = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "x", "uid": "u-1"},
    }
    owned = with_owner(child, owner)
    assert owned["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "InferenceDeployment",
            "name": "x",
            "uid": "u-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert "ownerReferences" not in child["metadata"]


class _Client:
    """call_api answering with the given errors first, then {}."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def call_api(self, *args: object, **kwargs: object) -> dict:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return {"ok": True}


def _api_error(status: int, reason: str, message: str, retry_after: str | None = None):
    from kubernetes_asyncio.client.exceptions import ApiException

    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps({"kind": "Status", "message": message})
    exc.headers = {"Retry-After": retry_after} if retry_after else {"Audit-Id": "x" * 40}
    return exc


async def test_a_429_is_retried_after_one_warning_line_each(caplog, monkeypatch) -> None:
    from kvfleet_operator import apply

    monkeypatch.setattr(apply.asyncio, "sleep", _no_sleep)
    storage = _api_error(429, "Too Many Requests", "storage is (re)initializing", "1")
    client = _Client(storage, storage)
    cluster = apply.Cluster(client)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        assert await cluster.get("v1", "Pod", "p", "ns") == {"ok": True}
    assert client.calls == 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "GET /api/v1/namespaces/ns/pods/p: 429 Too Many Requests: storage is (re)initializing; "
        f"retry {k} of 5 in 1 s"
        for k in (1, 2)
    ]
    assert "Audit-Id" not in caplog.text and "HTTP response" not in caplog.text


async def test_a_conflict_is_raised_and_summarized_in_one_line() -> None:
    from kubernetes_asyncio.client.exceptions import ApiException

    from kvfleet_operator import apply

    conflict = _api_error(409, "Conflict", "the object has been modified")
    cluster = apply.Cluster(_Client(conflict))  # type: ignore[arg-type]
    with pytest.raises(ApiException) as raised:
        await cluster.get("v1", "Pod", "p", "ns")
    summary = apply.api_error_summary(raised.value)
    assert summary == "409 Conflict: the object has been modified"
    assert "\n" not in summary


async def _no_sleep(seconds: float) -> None:
    return None
