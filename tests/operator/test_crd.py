"""The committed CRDs match the models, and their schemas are structural."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvfleet_operator.crd import inference_deployment_crd, main, render_crds

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crds_match_the_models() -> None:
    for name, text in render_crds().items():
        committed = ROOT / "crds" / name
        assert committed.exists(), f"{committed} missing: run `kvfleet crds`"
        assert committed.read_text() == text, f"{committed} is stale: run `kvfleet crds`"


def test_check_mode_reports_drift(tmp_path: Path, capsys: Any) -> None:
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "kvfleet.io_inferencedeployments.yaml").write_text("stale")
    assert main(["--out", str(tmp_path), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{key}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _schema() -> dict[str, Any]:
    version = inference_deployment_crd()["spec"]["versions"][0]
    return version["schema"]["openAPIV3Schema"]


def test_schema_is_structural_with_defaults_only_on_scalar_leaves() -> None:
    for path, node in _walk(_schema()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not {"$ref", "anyOf", "allOf", "oneOf", "title", "$defs"} & node.keys(), path
        if "default" in node:
            assert node["type"] in {"string", "integer", "number", "boolean"}, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, path


def test_replicas_has_no_default_and_spec_rules_are_present() -> None:
    spec = _schema()["properties"]["spec"]
    assert "default" not in spec["properties"]["replicas"]
    messages = " | ".join(r["message"] for r in spec["x-kubernetes-validations"])
    assert "either replicas or autoscaling" in messages
    assert "minReplicas must be <= autoscaling.maxReplicas" in messages
    model = spec["properties"]["model"]
    assert model["properties"]["uri"]["pattern"] == "^(hf|pvc|s3|file)://.+"
    assert "oldSelf" in model["x-kubernetes-validations"][0]["rule"]
    tensor = spec["properties"]["parallelism"]["properties"]["tensor"]
    assert tensor["x-kubernetes-validations"][0]["rule"] == "self in [1, 2, 4, 8, 16]"
    weights = spec["properties"]["quantization"]["properties"]["weights"]
    assert weights["enum"] == ["none", "int8", "fp8", "int4-awq", "int4-gptq"]


def test_scale_subresource_and_printer_columns() -> None:
    version = inference_deployment_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    names = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert names == [
        "Model", "Ready", "Replicas", "Accelerator", "TP", "Quantization", "Scaling", "Age"
    ]  # fmt: skip


def test_kopf_state_has_room_in_status() -> None:
    status = _schema()["properties"]["status"]
    assert status["properties"]["kopf"]["x-kubernetes-preserve-unknown-fields"] is True
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"


def test_generated_yaml_has_no_anchors() -> None:
    files = render_crds()
    for name, text in files.items():
        assert "&id" not in text and "*id" not in text
        kind = yaml.safe_load(text)["kind"]
        assert kind == ("Kustomization" if name == "Kustomization" else "CustomResourceDefinition")
    kustomization = yaml.safe_load(files["Kustomization"])
    assert sorted(kustomization["resources"]) == sorted(n for n in files if n.endswith(".yaml"))


def test_printer_columns_point_at_schema_fields() -> None:
    from kvfleet_operator.crd import accelerator_profile_crd

    for crd in (inference_deployment_crd(), accelerator_profile_crd()):
        version = crd["spec"]["versions"][0]
        schema = version["schema"]["openAPIV3Schema"]
        for column in version["additionalPrinterColumns"]:
            path = column["jsonPath"].split("[", 1)[0].strip(".").split(".")
            if path[0] == "metadata":
                continue
            node = schema
            for part in path:
                assert part in node.get("properties", {}), f"{column['jsonPath']}: no {part}"
                node = node["properties"][part]
