"""Rendering, pure: the child objects of one InferenceDeployment as plain dicts.

Owner references are added by `apply`, the one place objects are sent to the API server.
`app.kubernetes.io/instance` is deliberately absent: Argo CD tracks its applications by that
label by default and would treat the children as its own.
"""

from __future__ import annotations

import math
import posixpath
from dataclasses import dataclass
from typing import Any

from kvfleet_operator import api
from kvfleet_operator.autoscaling.actuators import render_external_autoscaler
from kvfleet_operator.models import AcceleratorProfileSpec, InferenceDeploymentSpec
from kvfleet_operator.plan import Plan
from kvfleet_operator.render_router import render_router

MODEL_DIR = "/models"
PRE_STOP_SECONDS = 5
STARTUP_PERIOD_SECONDS = 10
S3_IMAGE = "amazon/aws-cli:2.22.35"
# Engine pods speak vLLM's model-server protocol (its metric names, vllm:cache_config_info), so
# llm-d's router or any Gateway API Inference Extension endpoint picker can front them.
ENGINE_TYPE_LABEL = {"llm-d.ai/engine-type": "vllm"}
# quantization.weights -> `kvfleet serve --quantization`; `none` passes no flag, so the engine
# reads the checkpoint's config.json (a plain checkpoint then loads as bf16).
ENGINE_QUANTIZATION = {"int8": "int8", "fp8": "fp8", "int4-awq": "awq", "int4-gptq": "gptq"}
Manifest = dict[str, Any]


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvfleet-engine",
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/part-of": "kvfleet",
        "app.kubernetes.io/managed-by": api.FIELD_MANAGER,
        api.DEPLOYMENT_LABEL: name,
    }


def selector(name: str) -> dict[str, str]:
    return {api.DEPLOYMENT_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def endpoint_url(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc:{api.ENGINE_PORT}/v1"


def render_children(
    name: str,
    namespace: str,
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
    *,
    service_monitor: bool,
) -> list[Manifest]:
    """Every child, in apply order."""
    children = [
        render_deployment(name, namespace, spec, plan, profile),
        render_service(name, namespace),
        render_pod_disruption_budget(name, namespace),
    ]
    if service_monitor:
        children.append(render_service_monitor(name, namespace))
    if spec.autoscaling is not None and spec.autoscaling.controller != "Builtin":
        children.append(render_external_autoscaler(name, namespace, labels(name), spec.autoscaling))
    if spec.routing.enabled:
        children += render_router(name, namespace, spec, plan)
    return children


def _metadata(name: str, namespace: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(name)}


def render_deployment(
    name: str,
    namespace: str,
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
) -> Manifest:
    assert plan.topology is not None and plan.topology.kind == "Deployment", plan.topology
    source = _model_source(spec)
    drain = spec.rollout.drain_timeout_seconds
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector(name)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable,
            },
        },
        "progressDeadlineSeconds": max(600, plan.startup_timeout_seconds + 120),
        "revisionHistoryLimit": 3,
        "template": {
            "metadata": {"labels": {**labels(name), **ENGINE_TYPE_LABEL}},
            "spec": {
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": 1000,
                    "runAsGroup": 1000,
                    "fsGroup": 1000,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "terminationGracePeriodSeconds": PRE_STOP_SECONDS + drain + 10,
                "nodeSelector": dict(profile.node_selector),
                "tolerations": [
                    t.model_dump(by_alias=True, exclude_none=True) for t in profile.tolerations
                ],
                "initContainers": source.init_containers,
                "containers": [_engine_container(name, spec, plan, profile, source)],
                "volumes": [
                    {
                        "name": "dshm",
                        "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory},
                    },
                    {"name": "tmp", "emptyDir": {}},
                    source.volume,
                ],
            },
        },
    }
    replicas = spec.effective_replicas()
    if replicas is not None:  # left out when the autoscaler owns it
        deployment_spec = {"replicas": replicas, **deployment_spec}
    if not source.init_containers:
        del deployment_spec["template"]["spec"]["initContainers"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace),
        "spec": deployment_spec,
    }


def engine_args(spec: InferenceDeploymentSpec, plan: Plan, model_path: str) -> list[str]:
    """`kvfleet serve` arguments for the spec."""
    engine = spec.engine
    args = [
        "--model", model_path,
        "--served-model-name", plan.served_model_name,
        "--host", "0.0.0.0",
        "--port", str(api.ENGINE_PORT),
        "--block-size", str(engine.block_size),
        "--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}",
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
    ]  # fmt: skip
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.parallelism.tensor != 1:
        args += ["--tensor-parallel-size", str(spec.parallelism.tensor)]
    if spec.quantization.weights != "none":
        args += ["--quantization", ENGINE_QUANTIZATION[spec.quantization.weights]]
    if spec.quantization.kv_cache != "auto":
        args += ["--kv-cache-dtype", spec.quantization.kv_cache]
    args.append(
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    if engine.max_queued_requests is not None:
        args += ["--max-queued-requests", str(engine.max_queued_requests)]
    if engine.max_queued_tokens is not None:
        args += ["--max-queued-tokens", str(engine.max_queued_tokens)]
    if spec.sla.ttft_ms is not None:
        args += ["--ttft-slo-ms", str(spec.sla.ttft_ms)]
    if spec.sla.tpot_ms is not None:
        args += ["--tpot-slo-ms", str(spec.sla.tpot_ms)]
    args += ["--drain-timeout", str(spec.rollout.drain_timeout_seconds)]
    return args + list(engine.extra_args)


def rendered_weights(args: list[str]) -> str:
    """quantization.weights that an engine command line serves: the inverse of engine_args,
    reading the last `--quantization` as the engine's parser does (extraArgs come last); an
    engine name the CRD has no name for is returned as it is."""
    value = "none"
    for i, arg in enumerate(args):
        if arg == "--quantization" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--quantization="):
            value = arg.partition("=")[2]
    crd_names = {engine: crd for crd, engine in ENGINE_QUANTIZATION.items()}
    return crd_names.get(value, value)


def _engine_container(
    name: str,
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
    source: ModelSource,
) -> dict[str, Any]:
    assert plan.topology is not None
    limits: dict[str, Any] = {profile.resource_name: plan.topology.gpus_per_pod}
    requests: dict[str, Any] = {}
    for key, value in (("cpu", spec.resources.cpu), ("memory", spec.resources.memory)):
        if value is not None:
            limits[key] = requests[key] = value
    resources: dict[str, Any] = {"limits": limits}
    if requests:
        resources["requests"] = requests
    ready = {"path": "/ready", "port": "http"}
    return {
        "name": "engine",
        "image": spec.engine.image or api.DEFAULT_ENGINE_IMAGE,
        "command": ["kvfleet", "serve"],
        "args": engine_args(spec, plan, source.path),
        "ports": [{"name": "http", "containerPort": api.ENGINE_PORT, "protocol": "TCP"}],
        "env": _cache_env(),
        "resources": resources,
        "startupProbe": {
            "httpGet": dict(ready),
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(plan.startup_timeout_seconds / STARTUP_PERIOD_SECONDS),
        },
        "readinessProbe": {
            "httpGet": dict(ready),
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "model", "mountPath": source.mount_path, "readOnly": True},
        ],
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _cache_env() -> list[dict[str, str]]:
    # The root filesystem is read-only: every cache goes to the /tmp emptyDir.
    return [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
    ]


@dataclass(frozen=True)
class ModelSource:
    """Where the engine finds the weights, and how they get there."""

    path: str  # `--model`: a directory, or a .gguf file, in the engine container
    volume: dict[str, Any]  # the `model` volume
    mount_path: str  # where the engine container mounts that volume (read-only)
    init_containers: list[dict[str, Any]]  # fetch-model for hf:// and s3://, else none


def _model_source(spec: InferenceDeploymentSpec) -> ModelSource:
    model = spec.model
    scheme, rest = model.uri.split("://", 1)
    if scheme == "pvc":
        claim, _, sub_path = rest.partition("/")
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return ModelSource(f"{MODEL_DIR}/{sub_path}".rstrip("/"), volume, MODEL_DIR, [])
    if scheme == "file":
        if model.is_gguf:  # the one file, mounted under its own name
            path = f"{MODEL_DIR}/{posixpath.basename(rest)}"
            volume = {"name": "model", "hostPath": {"path": rest, "type": "File"}}
            return ModelSource(path, volume, path, [])
        volume = {"name": "model", "hostPath": {"path": rest, "type": "Directory"}}
        return ModelSource(MODEL_DIR, volume, MODEL_DIR, [])
    target = f"{MODEL_DIR}/model"
    path = target
    if scheme == "hf":
        if model.is_gguf:  # only that file: hf download ORG/REPO FILE.gguf
            repo, file = model.hf_file()
            command = ["hf", "download", repo, file, "--local-dir", target]
            path = f"{target}/{file}"
        else:
            command = ["hf", "download", rest, "--local-dir", target]
        if model.revision:
            command += ["--revision", model.revision]
        image = spec.engine.image or api.DEFAULT_ENGINE_IMAGE
    else:
        assert scheme == "s3", scheme
        if model.is_gguf:  # only that object
            path = f"{target}/{posixpath.basename(rest)}"
            command = ["aws", "s3", "cp", model.uri, path, "--no-progress"]
        else:
            command = ["aws", "s3", "sync", model.uri, target, "--no-progress"]
        image = S3_IMAGE
    fetch: dict[str, Any] = {
        "name": "fetch-model",
        "image": image,
        "command": command,
        "env": _cache_env(),
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "model", "mountPath": MODEL_DIR},
        ],
    }
    if model.credentials_secret is not None:
        fetch["envFrom"] = [{"secretRef": {"name": model.credentials_secret.name}}]
    return ModelSource(path, {"name": "model", "emptyDir": {}}, MODEL_DIR, [fetch])


def render_service(name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(name),
            "ports": [
                {"name": "http", "port": api.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def render_pod_disruption_budget(name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}},
    }


def render_service_monitor(name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(name, namespace),
        "spec": {
            "selector": {"matchLabels": selector(name)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }
