"""CustomResourceDefinitions generated from the typed models: `kvfleet crds [--out DIR]`.

Pydantic's JSON schema is turned into a Kubernetes structural schema: references inlined,
Optional[X] collapsed to X, draft-2020 keywords rewritten to OpenAPI v3.0, titles dropped and
defaults kept only on scalar leaves (an object or list default would be written into every
user's spec by the API server, which GitOps tools then report as drift).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from kvfleet_operator import api
from kvfleet_operator.models import (
    AcceleratorProfileSpec,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
)

_KEPT_KEYS = {
    "type",
    "description",
    "default",
    "enum",
    "format",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "required",
}
_SCALARS = {"string", "integer", "number", "boolean"}


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's schema as an OpenAPI v3.0 structural schema."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(schema, schema.get("$defs", {}))


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        return _convert({**target, **siblings}, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        assert len(options) == 1, f"unions other than Optional are not structural: {node}"
        siblings = {k: v for k, v in node.items() if k != "anyOf"}
        return _convert({**options[0], **siblings}, defs)

    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEPT_KEYS or k.startswith("x-")}
    if "enum" in node and "type" not in node:
        out["type"] = "string"
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if out.get("type") == "array":
        out["items"] = _convert(node.get("items", {}), defs)
        # pydantic writes max_length of a list as maxItems already; nothing else to do.
    if out.get("type") == "object":
        if "properties" in node:
            out["properties"] = {k: _convert(v, defs) for k, v in node["properties"].items()}
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and "properties" not in node:
            out["additionalProperties"] = _convert(extra, defs)
    if out.get("x-kubernetes-int-or-string"):  # a number or a string, as Kubernetes' own
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("default") is None or out.get("type") not in _SCALARS:
        out.pop("default", None)
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("properties", None)
    return _ordered(out)


_KEY_ORDER = ("type", "description", "required", "default", "enum")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Readable key order: type and description first, nested properties last."""
    first = [k for k in _KEY_ORDER if k in node]
    last = [k for k in ("items", "additionalProperties", "properties") if k in node]
    middle = sorted(k for k in node if k not in first and k not in last)
    return {k: node[k] for k in first + middle + last}


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _crd(
    *,
    kind: str,
    plural: str,
    scope: str,
    short_names: list[str],
    schema: dict[str, Any],
    subresources: dict[str, Any],
    columns: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short_names,
                "categories": ["kvfleet"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


# Every Kubernetes object's type and object metadata, described as the built-in kinds describe them.
_TYPE_META: dict[str, Any] = {
    "apiVersion": {
        "type": "string",
        "description": "The versioned schema of this object: kvfleet.io/v1alpha1.",
    },
    "kind": {"type": "string", "description": "The REST resource this object represents."},
    # The API server refuses anything but the type here (it documents ObjectMeta itself).
    "metadata": {"type": "object"},
}


def _condition(kind: str, field: str) -> str:
    return f'.status.conditions[?(@.type=="{kind}")].{field}'


def inference_deployment_crd() -> dict[str, Any]:
    spec = structural_schema(InferenceDeploymentSpec)
    status = structural_schema(InferenceDeploymentStatus)
    schema = {
        "type": "object",
        "description": "One model served by kvfleet engine pods.",
        "required": ["spec"],
        "x-kubernetes-validations": [
            {
                "rule": "size(self.metadata.name) <= 52",
                "message": "metadata.name must be at most 52 characters (child names derive "
                "from it)",
            },
            {
                "rule": "self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",
                "message": "metadata.name must be a DNS-1123 label (lowercase letters, digits "
                "and '-', no dots): it names the Service, whose name may not hold a dot",
            },
            {
                # At creation only (a name never changes): an object stored before the rule
                # stays editable, and its status writable, on the clusters that took it.
                "rule": "oldSelf.hasValue() || self.metadata.name.matches('^[a-z]')",
                "optionalOldSelf": True,
                "message": "metadata.name must start with a lowercase letter (a DNS-1035 "
                "label): it names the Services, which Kubernetes before 1.36 refuses to name "
                "with a leading digit",
            },
        ],
        "properties": {
            **_TYPE_META,
            "spec": {**spec, "description": "What to serve, on which GPUs, how to scale it."},
            "status": {**status, "description": "What the operator observed; written by it only."},
        },
    }
    columns: list[dict[str, Any]] = [
        {"name": "Model", "type": "string", "jsonPath": ".status.endpoint.servedModelName"},
        {"name": "Ready", "type": "string", "jsonPath": _condition("Ready", "status")},
        {"name": "Replicas", "type": "string", "jsonPath": ".status.replicasSummary"},
        {"name": "Accelerator", "type": "string", "jsonPath": ".spec.resources.accelerator"},
        {"name": "TP", "type": "integer", "jsonPath": ".status.topology.tensor"},
        {"name": "Quantization", "type": "string", "jsonPath": ".status.quantization"},
        {"name": "Scaling", "type": "string", "jsonPath": ".status.scaling"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {
            "name": "Reason",
            "type": "string",
            "jsonPath": _condition("Ready", "reason"),
            "priority": 1,
        },
        # `kubectl get infd -o wide` adds these (priority 1): the endpoint and the memory plan.
        {"name": "URL", "type": "string", "jsonPath": ".status.endpoint.url", "priority": 1},
        {
            "name": "GPU-GiB",
            "type": "number",
            "description": "GPU memory one GPU needs (weights + KV cache + overhead)",
            "jsonPath": ".status.memoryPlan.requiredGiB",
            "priority": 1,
        },
        {
            "name": "Avail-GiB",
            "type": "number",
            "description": "GPU memory one GPU offers (x gpuMemoryUtilization)",
            "jsonPath": ".status.memoryPlan.availableGiB",
            "priority": 1,
        },
        {"name": "Fits", "type": "boolean", "jsonPath": ".status.memoryPlan.fits", "priority": 1},
    ]
    return _crd(
        kind=api.INFERENCE_DEPLOYMENT,
        plural=api.INFERENCE_DEPLOYMENTS,
        scope="Namespaced",
        short_names=["infd"],
        schema=schema,
        subresources={
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
        columns=columns,
    )


def accelerator_profile_crd() -> dict[str, Any]:
    schema = {
        "type": "object",
        "description": "A GPU type: resource name, devices per node, memory, compute capability, "
        "and where such nodes are.",
        "required": ["spec"],
        "properties": {
            **_TYPE_META,
            "spec": {
                **structural_schema(AcceleratorProfileSpec),
                "description": "The device, its memory and where such nodes are.",
            },
        },
    }
    columns = [
        {"name": "Resource", "type": "string", "jsonPath": ".spec.resourceName"},
        {"name": "Memory-GiB", "type": "number", "jsonPath": ".spec.memoryGiB"},
        {"name": "CC", "type": "string", "jsonPath": ".spec.computeCapability"},
        {"name": "Per-Node", "type": "integer", "jsonPath": ".spec.devicesPerNode"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _crd(
        kind=api.ACCELERATOR_PROFILE,
        plural=api.ACCELERATOR_PROFILES,
        scope="Cluster",
        short_names=["accel"],
        schema=schema,
        subresources={},
        columns=columns,
    )


def render_crds() -> dict[str, str]:
    """File name -> text for every CRD and the directory's Kustomization, as committed in crds/."""
    header = "# Generated by `kvfleet crds` from kvfleet_operator.models. Do not edit.\n"
    crds = {
        "kvfleet.io_inferencedeployments.yaml": inference_deployment_crd(),
        "kvfleet.io_acceleratorprofiles.yaml": accelerator_profile_crd(),
    }
    files = {
        name: header + yaml.dump(crd, Dumper=_NoAliasDumper, sort_keys=False, width=100)
        for name, crd in crds.items()
    }
    # No .yaml extension, so `kubectl apply -f crds/` skips it while `-k manifests/` uses it.
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(crds),
    }
    files["Kustomization"] = header + yaml.safe_dump(kustomization, sort_keys=False)
    return files


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet crds", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("crds"), help="directory (default crds/)")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the files in --out differ from the models"
    )
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_crds().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(f"out of date (run `kvfleet crds`): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0
