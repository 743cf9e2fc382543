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
        if node.get("x-kubernetes-int-or-string"):  # the one union a structural schema allows
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            assert "type" not in node and not {"allOf", "oneOf"} & node.keys(), path
            continue
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
    assert (
        "model.uri: hf://ORG/NAME"
        in model["properties"]["uri"]["x-kubernetes-validations"][0]["message"]
    )
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


def test_a_gguf_uri_must_name_a_file_in_its_source() -> None:
    import re

    import pytest
    from pydantic import ValidationError

    from kvfleet_operator.models import GGUF_URI_MESSAGE, GGUF_URI_PATTERN, ModelSpec

    uri = _schema()["properties"]["spec"]["properties"]["model"]["properties"]["uri"]
    rule = uri["x-kubernetes-validations"][-1]
    assert rule["rule"] == f"!self.endsWith('.gguf') || self.matches('{GGUF_URI_PATTERN}')"
    assert rule["message"] == GGUF_URI_MESSAGE
    valid = [
        "hf://bartowski/Llama-3.1-8B-GGUF/Llama-3.1-8B-Q4_K_M.gguf",
        "hf://unsloth/Qwen3-8B-GGUF/Q4_K_M/Qwen3-8B-Q4_K_M.gguf",
        "pvc://models/llama/llama.gguf",
        "pvc://models/llama.gguf",
        "s3://bucket/llama.gguf",
        "file:///var/models/llama.gguf",
    ]
    invalid = [
        "hf://bartowski/llama.gguf",  # a repository, no file
        "pvc://llama.gguf",  # a claim, no file
        "s3://llama.gguf",
        "file://llama.gguf",  # not an absolute path
        "hf://org/repo/.gguf",
    ]
    for value in valid:
        assert re.match(GGUF_URI_PATTERN, value), value
        assert ModelSpec(uri=value).is_gguf
    for value in invalid:
        assert not re.match(GGUF_URI_PATTERN, value), value
        with pytest.raises(ValidationError, match=re.escape(GGUF_URI_MESSAGE)):
            ModelSpec(uri=value)
    # Other URIs stay directories.
    assert not ModelSpec(uri="hf://meta-llama/Llama-3.1-8B-Instruct").is_gguf
    assert not ModelSpec(uri="pvc://models/repo.gguf/").is_gguf


def test_a_kv_calibration_needs_an_fp8_cache_and_a_path_inside_the_model() -> None:
    import pytest
    from pydantic import ValidationError

    from kvfleet_operator.kinds.model import CALIBRATION_MESSAGE, FILE_GGUF_CALIBRATION
    from kvfleet_operator.models import InferenceDeploymentSpec, QuantizationSpec

    spec = _schema()["properties"]["spec"]
    quantization = spec["properties"]["quantization"]
    rules = [rule["message"] for rule in quantization["x-kubernetes-validations"]]
    assert rules == ["quantization.kvCacheCalibration needs quantization.kvCache: fp8"]
    field = quantization["properties"]["kvCacheCalibration"]
    assert [rule["message"] for rule in field["x-kubernetes-validations"]] == [CALIBRATION_MESSAGE]
    assert FILE_GGUF_CALIBRATION in [rule["message"] for rule in spec["x-kubernetes-validations"]]

    assert QuantizationSpec(kvCache="fp8", kvCacheCalibration="cal/kv.safetensors")
    with pytest.raises(ValidationError, match=r"needs quantization\.kvCache: fp8"):
        QuantizationSpec(kvCache="int8", kvCacheCalibration="kv.safetensors")
    for path in ("../kv.safetensors", "a/./kv.safetensors", "/abs/kv.safetensors", "a//b"):
        with pytest.raises(ValidationError):
            QuantizationSpec(kvCache="fp8", kvCacheCalibration=path)
    base = {"resources": {"accelerator": "h100-80gb"}}
    calibrated = {"kvCache": "fp8", "kvCacheCalibration": "kv.safetensors"}
    with pytest.raises(ValidationError, match=r"cannot be used with a file:// \.gguf model"):
        InferenceDeploymentSpec.model_validate(
            {**base, "model": {"uri": "file:///m/x.gguf"}, "quantization": calibrated}
        )
    InferenceDeploymentSpec.model_validate(
        {**base, "model": {"uri": "file:///m/llama"}, "quantization": calibrated}
    )


def test_a_rollout_that_cannot_move_and_resources_that_are_not_quantities_are_refused() -> None:
    """What the API server would refuse when the operator applies the Deployment (a 422 on
    every reconcile, status frozen) is refused when the InferenceDeployment is written."""
    import re

    import pytest
    from pydantic import ValidationError

    from kvfleet_operator.kinds.serving import ROLLOUT_MESSAGE, RolloutSpec
    from kvfleet_operator.kinds.topology import QUANTITY_PATTERN, ResourcesSpec

    spec = _schema()["properties"]["spec"]
    rollout = spec["properties"]["rollout"]
    assert [r["message"] for r in rollout["x-kubernetes-validations"]] == [ROLLOUT_MESSAGE]
    with pytest.raises(ValidationError, match="cannot both be 0"):
        RolloutSpec(maxUnavailable=0)
    assert RolloutSpec(maxSurge=1, maxUnavailable=0).max_unavailable == 0
    for good in ("8", "7500m", "0.5", "64Gi", "70G", "1e3", ".5"):
        assert re.match(QUANTITY_PATTERN, good), good
        assert ResourcesSpec(accelerator="h100-80gb", cpu=good, memory=good)
    for bad in ("two", "8 cores", "-1", "64GiB", "1.5.2", ""):
        with pytest.raises(ValidationError):
            ResourcesSpec(accelerator="h100-80gb", cpu=bad)


def test_hints_without_a_context_length_need_max_model_len() -> None:
    """Without either, the memory plan counted a KV cache of 0 GiB and said the model fits."""
    import pytest
    from pydantic import ValidationError

    from kvfleet_operator.kinds.model import HINTS_CONTEXT_MESSAGE, ModelSpec

    hints = {"numParameters": 8_030_261_248, "numLayers": 32, "numAttentionHeads": 32,
             "numKeyValueHeads": 8, "headDim": 128}  # fmt: skip
    model = _schema()["properties"]["spec"]["properties"]["model"]
    assert HINTS_CONTEXT_MESSAGE in [r["message"] for r in model["x-kubernetes-validations"]]
    with pytest.raises(ValidationError, match=r"needs model\.maxModelLen"):
        ModelSpec(uri="hf://org/custom", hints=hints)
    assert ModelSpec(uri="hf://org/custom", hints=hints, maxModelLen=4096)
    assert ModelSpec(uri="hf://org/custom", hints={**hints, "maxPositionEmbeddings": 8192})


def test_a_model_uri_names_one_source_and_nothing_else() -> None:
    """model.uri ends up in init-container and engine arguments and, for file://, in a hostPath
    volume: an option (hf://--help), whitespace, a relative or root path on the node and `..`
    segments are refused with the forms it takes; at admission (CEL, the same pattern) and by
    the operator for objects stored before the rules."""
    import re

    import pytest
    from pydantic import ValidationError

    from kvfleet_operator.kinds.model import (
        MODEL_URI_MESSAGE,
        MODEL_URI_PATTERN,
        PARENT_SEGMENT_MESSAGE,
    )
    from kvfleet_operator.models import ModelSpec

    uri = _schema()["properties"]["spec"]["properties"]["model"]["properties"]["uri"]
    rules = [(r["rule"], r["message"]) for r in uri["x-kubernetes-validations"]]
    assert (f"self.matches(r'{MODEL_URI_PATTERN}')", MODEL_URI_MESSAGE) in rules
    assert rules[1][1] == PARENT_SEGMENT_MESSAGE
    for value in [
        "hf://meta-llama/Llama-3.1-8B-Instruct", "hf://gpt2", "hf://org/repo/sub/x.Q4_0.gguf",
        "pvc://models/llama", "pvc://models", "s3://bucket/prefix/", "file:///var/models/x",
    ]:  # fmt: skip
        assert re.match(MODEL_URI_PATTERN, value), value
        ModelSpec(uri=value)
    for value in [
        "hf://--help", "hf://meta-llama/Llama 3.1 8B", "hf://-org/x", "pvc:///x", "pvc://:",
        "pvc://Models/x", "file:///", "file://relative/dir", "s3://", "ftp://host/x",
        # hf download takes a repository id: a directory inside one was rendered as an id that
        # does not exist, and the download init container crash-looped
        "hf://meta-llama/Llama-3.1-8B-Instruct/original", "hf://org/repo.gguf/",
        "hf://org/repo/Model.Q4.GGUF", "hf://org/repo?rev=x",
    ]:  # fmt: skip
        assert not re.match(MODEL_URI_PATTERN, value), value
        with pytest.raises(ValidationError, match=re.escape(MODEL_URI_MESSAGE)):
            ModelSpec(uri=value)
    for value in ["pvc://models/../../etc", "file:///var/models/..", "s3://bucket/x/../y"]:
        with pytest.raises(ValidationError, match=re.escape(PARENT_SEGMENT_MESSAGE)):
            ModelSpec(uri=value)
    with pytest.raises(ValidationError, match="revision"):
        ModelSpec(uri="hf://org/name", revision="--help")
