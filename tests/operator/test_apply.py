"""The apply layer's pure parts: resource paths and owner references."""

from __future__ import annotations

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
