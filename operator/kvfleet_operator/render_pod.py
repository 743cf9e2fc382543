"""Rendering, pure: the engine pod. Its template spec, the engine container with its `kvfleet
serve` arguments, and where the weights come from; render.py wraps it in a Deployment,
render_group.py in a LeaderWorkerSet or one StatefulSet per replica.
"""

from __future__ import annotations

import math
import posixpath
from dataclasses import dataclass, field
from typing import Any

from kvfleet_operator import api
from kvfleet_operator.models import AcceleratorProfileSpec, InferenceDeploymentSpec
from kvfleet_operator.plan import Plan
from kvfleet_operator.topology import shared_memory

MODEL_DIR = "/models"
PRE_STOP_SECONDS = 5
STARTUP_PERIOD_SECONDS = 10
S3_IMAGE = "amazon/aws-cli:2.22.35"
# Where the leader (node rank 0) of a multi-node group listens for the other ranks.
MASTER_PORT = 29500
# quantization.weights -> `kvfleet serve --quantization`; `none` passes no flag, so the engine
# reads the checkpoint's config.json (a plain checkpoint then loads as bf16).
ENGINE_QUANTIZATION = {"int8": "int8", "fp8": "fp8", "int4-awq": "awq", "int4-gptq": "gptq"}
API_KEY_ENV = "KVFLEET_API_KEY"  # `kvfleet serve` reads its API key from it
# The key of a group's step channel (the HMAC challenge each rank answers when it joins the
# leader), which the engine reads from this variable, and its key in the group's Secret.
PARALLEL_AUTHKEY_ENV = "KVFLEET_PARALLEL_AUTHKEY"
GROUP_KEY = "authkey"
# On every engine pod template: the pods speak vLLM's model-server protocol (its metric names,
# vllm:cache_config_info), so llm-d's router or any Gateway API Inference Extension endpoint
# picker can front them.
ENGINE_TYPE_LABEL = {"llm-d.ai/engine-type": "vllm"}


@dataclass(frozen=True)
class Ranks:
    """How one pod of a multi-node group finds its place: `kvfleet serve --nnodes --node-rank
    --master-addr --master-port`."""

    nnodes: int  # pods (nodes) in the group
    node_rank: str  # this pod's rank: `$(VAR)`, which the kubelet expands from `env`
    master_addr: str  # the leader pod's stable DNS name (or `$(VAR)`)
    key_secret: str  # the Secret holding the step channel's key (`group_key_secret`)
    env: list[dict[str, Any]] = field(default_factory=list)  # the variables those refer to

    def all_env(self) -> list[dict[str, Any]]:
        """`env`, and the step channel's key from the group's Secret. Optional: where the
        operator could not create the Secret (no `create` on secrets), the ranks still start,
        on the engine's default key (the NetworkPolicy then is what keeps others out)."""
        source = {"name": self.key_secret, "key": GROUP_KEY, "optional": True}
        return [*self.env, {"name": PARALLEL_AUTHKEY_ENV, "valueFrom": {"secretKeyRef": source}}]

    def args(self) -> list[str]:
        return [
            "--nnodes", str(self.nnodes),
            "--node-rank", self.node_rank,
            "--master-addr", self.master_addr,
            "--master-port", str(MASTER_PORT),
        ]  # fmt: skip


def pod_spec(
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
    *,
    ranks: Ranks | None = None,
    affinity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The spec of an engine pod (one rank of a group when `ranks` is given)."""
    assert plan.topology is not None
    source = _model_source(spec)
    drain = spec.rollout.drain_timeout_seconds
    pod: dict[str, Any] = {
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
        "containers": [_engine_container(spec, plan, profile, source, ranks)],
        "volumes": [
            {
                "name": "dshm",
                "emptyDir": {
                    "medium": "Memory",
                    "sizeLimit": shared_memory(
                        spec.resources.shared_memory, plan.topology.gpus_per_pod
                    ),
                },
            },
            {"name": "tmp", "emptyDir": {}},
            source.volume,
        ],
    }
    if affinity is not None:
        pod = {**dict(list(pod.items())[:4]), "affinity": affinity, **dict(list(pod.items())[4:])}
    if not source.init_containers:
        del pod["initContainers"]
    return pod


def engine_args(
    spec: InferenceDeploymentSpec, plan: Plan, model_path: str, ranks: Ranks | None = None
) -> list[str]:
    """`kvfleet serve` arguments for the spec (for one rank of a group with `ranks`)."""
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
    if spec.parallelism.pipeline != 1:
        args += ["--pipeline-parallel-size", str(spec.parallelism.pipeline)]
    if ranks is not None:
        args += ranks.args()
    if spec.quantization.weights != "none":
        args += ["--quantization", ENGINE_QUANTIZATION[spec.quantization.weights]]
    if spec.quantization.kv_cache != "auto":
        args += ["--kv-cache-dtype", spec.quantization.kv_cache]
    if spec.quantization.kv_cache_calibration is not None:
        args += ["--kv-cache-calibration", kv_calibration_path(spec, model_path)]
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
    spec: InferenceDeploymentSpec,
    plan: Plan,
    profile: AcceleratorProfileSpec,
    source: ModelSource,
    ranks: Ranks | None,
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
        "args": engine_args(spec, plan, source.path, ranks),
        "ports": [{"name": "http", "containerPort": api.ENGINE_PORT, "protocol": "TCP"}],
        "env": _cache_env() + (ranks.all_env() if ranks is not None else []) + _api_key_env(spec),
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


def _api_key_env(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    ref = spec.auth.api_key_secret_ref
    if ref is None:
        return []
    source = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
    return [{"name": API_KEY_ENV, "valueFrom": source}]


def annotate_pod_templates(workload: dict[str, Any], annotations: dict[str, str]) -> None:
    """Adds `annotations` to every pod template of a Deployment, StatefulSet or LeaderWorkerSet
    (its leader and worker templates), in place; the groups' headless Service has none."""
    spec = workload["spec"]
    if workload["kind"] == "LeaderWorkerSet":
        group = spec["leaderWorkerTemplate"]
        templates = [group[key] for key in ("leaderTemplate", "workerTemplate") if key in group]
    elif "template" in spec:
        templates = [spec["template"]]
    else:
        templates = []
    for template in templates:
        template.setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)


def _cache_env() -> list[dict[str, str]]:
    # The root filesystem is read-only: every cache goes to the /tmp emptyDir.
    return [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
    ]


def kv_calibration_path(spec: InferenceDeploymentSpec, model_path: str) -> str:
    """Where the engine container finds `quantization.kvCacheCalibration`: inside the model
    directory, or beside the .gguf file."""
    directory = posixpath.dirname(model_path) if spec.model.is_gguf else model_path
    return posixpath.join(directory, str(spec.quantization.kv_cache_calibration))


@dataclass(frozen=True)
class ModelSource:
    """Where the engine finds the weights, and how they get there."""

    path: str  # `--model`: a directory, or a .gguf file, in the engine container
    volume: dict[str, Any]  # the `model` volume
    mount_path: str  # where the engine container mounts that volume (read-only)
    # fetch-model (and fetch-kv-calibration beside an s3:// .gguf) for hf:// and s3://, else none
    init_containers: list[dict[str, Any]]


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
    calibration = spec.quantization.kv_cache_calibration
    fetches: dict[str, list[str]] = {}  # init container name -> command
    if scheme == "hf":
        if model.is_gguf:  # only that file (and the calibration beside it): hf download
            repo, file = model.hf_file()
            command = ["hf", "download", repo, file, "--local-dir", target]
            if calibration is not None:
                command.insert(4, posixpath.join(posixpath.dirname(file), calibration))
            path = f"{target}/{file}"
        else:
            command = ["hf", "download", rest, "--local-dir", target]
        if model.revision:
            command += ["--revision", model.revision]
        image = spec.engine.image or api.DEFAULT_ENGINE_IMAGE
    else:
        assert scheme == "s3", scheme
        if model.is_gguf:  # only that object (and the calibration beside it)
            path = f"{target}/{posixpath.basename(rest)}"
            command = ["aws", "s3", "cp", model.uri, path, "--no-progress"]
            if calibration is not None:
                source = posixpath.join(posixpath.dirname(model.uri), calibration)
                copy = ["aws", "s3", "cp", source, f"{target}/{calibration}", "--no-progress"]
                fetches["fetch-kv-calibration"] = copy
        else:
            command = ["aws", "s3", "sync", model.uri, target, "--no-progress"]
        image = S3_IMAGE
    containers = []
    for name, argv in {"fetch-model": command, **fetches}.items():
        fetch: dict[str, Any] = {
            "name": name,
            "image": image,
            "command": argv,
            "env": _cache_env(),
            "securityContext": _container_security(),
            "volumeMounts": [
                {"name": "tmp", "mountPath": "/tmp"},
                {"name": "model", "mountPath": MODEL_DIR},
            ],
        }
        if model.credentials_secret is not None:
            fetch["envFrom"] = [{"secretRef": {"name": model.credentials_secret.name}}]
        containers.append(fetch)
    return ModelSource(path, {"name": "model", "emptyDir": {}}, MODEL_DIR, containers)
