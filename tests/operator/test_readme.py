"""Every spec field a user can set is in the README's spec reference."""

from __future__ import annotations

import re
from pathlib import Path

from kvfleet_operator.crd import structural_schema
from kvfleet_operator.models import InferenceDeploymentSpec

README = Path(__file__).resolve().parents[2] / "README.md"


def _leaf_paths(node: dict, path: str = ""):
    properties = node.get("properties")
    if properties and not path.endswith("autoscaling"):  # documented by the autoscaling section
        for key, child in properties.items():
            yield from _leaf_paths(child, f"{path}.{key}" if path else key)
    else:
        yield path


def test_spec_reference_covers_every_field() -> None:
    text = README.read_text()
    section = text.split("## Operator and InferenceDeployment", 1)[1]
    table = section.split("### Spec reference", 1)[1].split("###", 1)[0]
    documented = set()
    for cell in re.findall(r"^\| (.+?) \|", table, flags=re.M):
        for code in re.findall(r"`([^`]+)`", cell):
            prefix, _, rest = code.partition(".{")
            if rest:  # `model.hints.{a, b}`
                documented |= {f"{prefix}.{name.strip()}" for name in rest.rstrip("}").split(",")}
            else:
                documented.add(code)
    fields = _leaf_paths(structural_schema(InferenceDeploymentSpec))
    missing = [path for path in fields if path not in documented]
    assert not missing, f"README spec reference lacks {missing}"
