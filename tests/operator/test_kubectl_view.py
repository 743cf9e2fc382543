"""What `kubectl explain` and `kubectl get -o wide` show, read from the generated CRDs."""

from __future__ import annotations

import re
from typing import Any

from kvfleet_operator.crd import accelerator_profile_crd, inference_deployment_crd


def _undocumented(node: dict[str, Any], path: str) -> list[str]:
    missing = [] if node.get("description") else [path or "."]
    for name, child in (node.get("properties") or {}).items():
        missing += _undocumented(child, f"{path}.{name}")
    if "items" in node:
        missing += _undocumented(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        missing += _undocumented(node["additionalProperties"], f"{path}{{}}")
    return missing


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def test_kubectl_explain_documents_every_field_of_both_crds() -> None:
    for crd in (inference_deployment_crd(), accelerator_profile_crd()):
        # metadata may carry nothing but its type: the API server documents ObjectMeta
        assert _undocumented(_schema(crd), "") == [".metadata"], crd["metadata"]["name"]


def _resolves(schema: dict[str, Any], json_path: str) -> bool:
    node = schema
    for step in re.sub(r"\[\?\(@\.type==\"\w+\"\)\]", "[]", json_path).strip(".").split("."):
        if step.endswith("[]"):
            node = node["properties"].get(step[:-2], {}).get("items", {})
        elif step in ("metadata", "creationTimestamp") and node.get("type") == "object":
            return True  # ObjectMeta is not spelled out in a CRD schema
        else:
            node = node.get("properties", {}).get(step, {})
        if not node:
            return False
    return True


def test_wide_output_adds_reason_endpoint_and_memory_plan_and_every_column_resolves() -> None:
    crd = inference_deployment_crd()
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    wide = [c["name"] for c in columns if c.get("priority") == 1]
    assert wide == ["Reason", "URL", "GPU-GiB", "Avail-GiB", "Fits"]
    for column in columns:
        assert _resolves(_schema(crd), column["jsonPath"]), column
