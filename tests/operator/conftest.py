"""Helpers for the operator's cluster-free tests."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvfleet_operator.models import InferenceDeploymentSpec

BASE_SPEC: dict[str, Any] = {
    "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
    "resources": {"accelerator": "h100-80gb"},
    "replicas": 2,
}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@pytest.fixture
def make_spec():
    """make_spec(parallelism={"tensor": 2}) -> InferenceDeploymentSpec; None removes a key."""

    def build(**override: Any) -> InferenceDeploymentSpec:
        return InferenceDeploymentSpec.model_validate(merge(BASE_SPEC, override))

    return build
