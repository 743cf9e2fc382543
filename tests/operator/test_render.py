"""Rendering against golden YAML (regenerate with UPDATE_GOLDEN=1 after a deliberate change)."""

from __future__ import annotations

import pytest

from kvfleet_operator.accelerators import resolve_accelerator
from kvfleet_operator.gguf_header import parse_gguf_header
from kvfleet_operator.model_catalog import model_architecture
from kvfleet_operator.plan import ClusterFeatures, plan_deployment
from kvfleet_operator.render import render_children, render_deployment
from kvfleet_operator.render_pod import engine_args, rendered_weights

CLUSTER = ClusterFeatures(leader_worker_set=False, service_monitor=True)


def children(spec, name="llama", service_monitor=True, api_key_digest=None):
    profile = resolve_accelerator(spec.resources.accelerator, {})
    p = plan_deployment(name, spec, profile, model_architecture(spec.model), CLUSTER)
    assert p.ok, p.problems
    return render_children(
        name, "team-a", spec, p, profile, service_monitor=service_monitor,
        api_key_digest=api_key_digest,
    )  # fmt: skip


def test_hf_model_with_fixed_replicas(check_golden, make_spec) -> None:
    spec = make_spec(
        model={"credentialsSecret": {"name": "hf-token"}, "revision": "0e9e39f"},
        sla={"ttftMs": 500, "tpotMs": 50},
        resources={"cpu": "8", "memory": "64Gi"},
    )
    check_golden("hf-fixed-replicas", children(spec))


def test_pvc_model_with_autoscaling_no_service_monitor_and_no_router(
    check_golden, make_spec
) -> None:
    spec = make_spec(
        model={"uri": "pvc://models/llama-3.1-8b-instruct"},
        replicas=None,
        autoscaling={
            "minReplicas": 1,
            "maxReplicas": 4,
            "targets": {"kvCacheUtilization": 0.7},
        },
        engine={
            "enablePrefixCaching": False,
            "maxQueuedRequests": 512,
            "maxQueuedTokens": 65536,
            "extraArgs": ["--seed", "1"],
        },
        routing={"enabled": False},
    )
    objects = children(spec, service_monitor=False)
    assert [o["kind"] for o in objects] == [
        "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
    ]  # fmt: skip
    check_golden("pvc-autoscaling", objects)


def test_autoscaling_leaves_replicas_to_the_autoscaler(make_spec) -> None:
    spec = make_spec(
        replicas=None, autoscaling={"maxReplicas": 3, "targets": {"kvCacheUtilization": 0.7}}
    )
    assert "replicas" not in children(spec)[0]["spec"]
    assert children(make_spec(replicas=3))[0]["spec"]["replicas"] == 3
    assert children(make_spec(replicas=3, suspend=True))[0]["spec"]["replicas"] == 0


def test_s3_and_file_sources(make_spec) -> None:
    s3 = children(make_spec(model={"uri": "s3://bucket/llama-3.1-8b-instruct"}))[0]
    pod = s3["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["command"][:3] == ["aws", "s3", "sync"]
    assert pod["volumes"][-1] == {"name": "model", "emptyDir": {}}
    local = children(make_spec(model={"uri": "file:///var/models/llama-3.1-8b-instruct"}))[0]
    pod = local["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert pod["volumes"][-1]["hostPath"] == {
        "path": "/var/models/llama-3.1-8b-instruct",
        "type": "Directory",
    }
    assert engine_args_of(local)[:2] == ["--model", "/models"]


def engine_args_of(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_gpu_limit_follows_parallelism_and_profile(make_spec) -> None:
    spec = make_spec(parallelism={"tensor": 2}, resources={"accelerator": "l40s"})
    profile = resolve_accelerator("l40s", {})
    p = plan_deployment("x", spec, profile, model_architecture(spec.model), CLUSTER)
    assert p.ok, p.problems
    deployment = render_deployment("x", "ns", spec, p, profile)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L40S"}
    assert "--tensor-parallel-size" in engine_args(spec, p, "/models/model")


def test_spec_change_changes_the_pod_template(make_spec) -> None:
    before = children(make_spec())[0]["spec"]["template"]
    after = children(make_spec(engine={"maxNumSeqs": 64}))[0]["spec"]["template"]
    assert before != after
    assert "64" in after["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("drain", [0, 30, 120])
def test_termination_grace_covers_prestop_and_drain(make_spec, drain: int) -> None:
    pod = children(make_spec(rollout={"drainTimeoutSeconds": drain}))[0]["spec"]["template"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 5 + drain + 10
    assert engine_args_of({"spec": pod and {"template": pod}})[-2:] == [
        "--drain-timeout",
        str(drain),
    ]


HF_GGUF = "hf://bartowski/Meta-Llama-3.1-8B-Instruct-GGUF/Meta-Llama-3.1-8B-Instruct-Q4_1.gguf"
GGUF_FILE = "Llama-3.1-8B-Instruct-Q4_1.gguf"
HINTS = {
    "numParameters": 8_030_261_248, "numLayers": 32, "numAttentionHeads": 32,
    "numKeyValueHeads": 8, "headDim": 128,
}  # fmt: skip


def gguf_deployment(spec, header=None):
    profile = resolve_accelerator(spec.resources.accelerator, {})
    architecture = model_architecture(spec.model, header)
    p = plan_deployment("llama", spec, profile, architecture, CLUSTER)
    assert p.ok, p.problems
    return render_deployment("llama", "team-a", spec, p, profile)


def pod_of(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def test_hf_gguf_downloads_only_that_file(check_golden, make_spec, write_gguf) -> None:
    gguf = write_gguf(with_data=False, layers=32, hidden=4096, context=8192)
    header = parse_gguf_header(gguf.read_bytes())
    spec = make_spec(
        model={"uri": HF_GGUF, "revision": "9a8b7c6", "credentialsSecret": {"name": "hf-token"}}
    )
    deployment = gguf_deployment(spec, header)
    check_golden("gguf-hf", [deployment])
    fetch = pod_of(deployment)["initContainers"][0]
    assert fetch["command"] == [
        "hf", "download", "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF",
        "Meta-Llama-3.1-8B-Instruct-Q4_1.gguf", "--local-dir", "/models/model",
        "--revision", "9a8b7c6",
    ]  # fmt: skip
    assert engine_args_of(deployment)[:2] == [
        "--model", "/models/model/Meta-Llama-3.1-8B-Instruct-Q4_1.gguf"
    ]  # fmt: skip
    # A file in a folder of the repository keeps its folder.
    nested = make_spec(model={"uri": "hf://unsloth/Qwen3-8B-GGUF/Q4_K_M/Qwen3-8B-Q4_K_M.gguf"})
    deployment = gguf_deployment(nested)
    assert pod_of(deployment)["initContainers"][0]["command"][2:4] == [
        "unsloth/Qwen3-8B-GGUF", "Q4_K_M/Qwen3-8B-Q4_K_M.gguf"
    ]  # fmt: skip
    assert engine_args_of(deployment)[1] == "/models/model/Q4_K_M/Qwen3-8B-Q4_K_M.gguf"


def test_pvc_gguf_mounts_the_claim_and_points_at_the_file(check_golden, make_spec) -> None:
    spec = make_spec(model={"uri": f"pvc://models/llama/{GGUF_FILE}", "hints": HINTS})
    deployment = gguf_deployment(spec)
    check_golden("gguf-pvc", [deployment])
    assert pod_of(deployment)["volumes"][-1]["persistentVolumeClaim"]["claimName"] == "models"
    assert engine_args_of(deployment)[:2] == ["--model", f"/models/llama/{GGUF_FILE}"]


def test_s3_gguf_copies_only_that_object(check_golden, make_spec) -> None:
    spec = make_spec(
        model={"uri": f"s3://models/llama/{GGUF_FILE}", "credentialsSecret": {"name": "aws"}}
    )
    deployment = gguf_deployment(spec)
    check_golden("gguf-s3", [deployment])
    assert pod_of(deployment)["initContainers"][0]["command"] == [
        "aws", "s3", "cp", f"s3://models/llama/{GGUF_FILE}", f"/models/model/{GGUF_FILE}",
        "--no-progress",
    ]  # fmt: skip
    assert engine_args_of(deployment)[:2] == ["--model", f"/models/model/{GGUF_FILE}"]


def test_file_gguf_mounts_the_one_file(check_golden, make_spec) -> None:
    spec = make_spec(model={"uri": f"file:///var/models/{GGUF_FILE}"})
    deployment = gguf_deployment(spec)
    check_golden("gguf-file", [deployment])
    pod = pod_of(deployment)
    assert pod["volumes"][-1]["hostPath"] == {"path": f"/var/models/{GGUF_FILE}", "type": "File"}
    mount = pod["containers"][0]["volumeMounts"][-1]
    assert mount == {"name": "model", "mountPath": f"/models/{GGUF_FILE}", "readOnly": True}
    assert engine_args_of(deployment)[:2] == ["--model", f"/models/{GGUF_FILE}"]


@pytest.mark.parametrize(
    ("weights", "engine_name"),
    [("int8", "int8"), ("fp8", "fp8"), ("int4-awq", "awq"), ("int4-gptq", "gptq")],
)
def test_quantization_flags_use_the_engine_names(make_spec, weights, engine_name) -> None:
    args = engine_args_of(children(make_spec(quantization={"weights": weights}))[0])
    assert args[args.index("--quantization") + 1] == engine_name
    assert "--kv-cache-dtype" not in args
    assert rendered_weights(args) == weights


def test_unquantized_spec_passes_no_quantization_flags(make_spec) -> None:
    args = engine_args_of(children(make_spec())[0])
    assert "--quantization" not in args and "--kv-cache-dtype" not in args
    assert rendered_weights(args) == "none"


def test_awq_weights_with_an_fp8_kv_cache(check_golden, make_spec) -> None:
    spec = make_spec(
        model={"uri": "hf://hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "hints": {
            **HINTS, "hiddenSize": 4096, "intermediateSize": 14336}},
        quantization={"weights": "int4-awq", "kvCache": "fp8"},
        resources={"accelerator": "l4"},
    )  # fmt: skip
    deployment = children(spec)[0]
    check_golden("awq-fp8-kv", [deployment])
    args = engine_args_of(deployment)
    assert args[args.index("--quantization") :][:2] == ["--quantization", "awq"]
    assert args[args.index("--kv-cache-dtype") :][:2] == ["--kv-cache-dtype", "fp8"]
    # 5.41 GiB of weights load in 120 s + 10 s per GiB: 175 s, 18 probes of 10 s.
    assert pod_of(deployment)["containers"][0]["startupProbe"]["failureThreshold"] == 18


CALIBRATION = "kv-calibration.safetensors"
CALIBRATED = {"kvCache": "fp8", "kvCacheCalibration": CALIBRATION}


def test_a_kv_calibration_reaches_the_engine_from_the_model_directory(make_spec) -> None:
    spec = make_spec(quantization=CALIBRATED)
    args = engine_args_of(children(spec)[0])
    model = args[args.index("--model") + 1]
    assert args[args.index("--kv-cache-calibration") + 1] == f"{model}/{CALIBRATION}"
    assert "--kv-cache-calibration" not in engine_args_of(children(make_spec())[0])
    directories = {"pvc://models/llama": "/models/llama", "file:///var/llama": "/models"}
    for uri, directory in directories.items():
        spec = make_spec(model={"uri": uri, "hints": HINTS}, quantization=CALIBRATED)
        args = engine_args_of(children(spec)[0])
        assert args[args.index("--kv-cache-calibration") + 1] == f"{directory}/{CALIBRATION}"


def test_a_kv_calibration_beside_a_gguf_file_is_fetched_with_it(make_spec) -> None:
    beside = {
        "hf": (HF_GGUF, "/models/model"),
        "pvc": (f"pvc://models/llama/{GGUF_FILE}", "/models/llama"),
        "s3": (f"s3://models/llama/{GGUF_FILE}", "/models/model"),
    }
    for scheme, (uri, directory) in beside.items():
        spec = make_spec(model={"uri": uri, "hints": HINTS}, quantization=CALIBRATED)
        deployment = gguf_deployment(spec)
        args = engine_args_of(deployment)
        assert args[args.index("--kv-cache-calibration") + 1] == f"{directory}/{CALIBRATION}"
        fetches = pod_of(deployment).get("initContainers", [])
        if scheme == "hf":  # hf download REPO FILE.gguf CALIBRATION --local-dir ...
            assert fetches[0]["command"][3:5] == [
                "Meta-Llama-3.1-8B-Instruct-Q4_1.gguf", CALIBRATION
            ]  # fmt: skip
        if scheme == "s3":
            assert [f["name"] for f in fetches] == ["fetch-model", "fetch-kv-calibration"]
            source, local = f"s3://models/llama/{CALIBRATION}", f"/models/model/{CALIBRATION}"
            assert fetches[1]["command"][:5] == ["aws", "s3", "cp", source, local]
    # In a folder of the repository, the calibration is read from beside the file.
    nested = make_spec(
        model={"uri": "hf://unsloth/Qwen3-8B-GGUF/Q4_K_M/Qwen3-8B-Q4_K_M.gguf"},
        quantization=CALIBRATED,
    )
    deployment = gguf_deployment(nested)
    assert pod_of(deployment)["initContainers"][0]["command"][4] == f"Q4_K_M/{CALIBRATION}"
    args = engine_args_of(deployment)
    assert args[args.index("--kv-cache-calibration") + 1] == f"/models/model/Q4_K_M/{CALIBRATION}"


def test_rendered_weights_reads_the_last_flag_as_the_engine_does() -> None:
    assert rendered_weights(["--quantization", "awq", "--quantization", "gptq"]) == "int4-gptq"
    assert rendered_weights(["--quantization", "awq", "--quantization=int8"]) == "int8"
    # An engine name the CRD does not have, given through engine.extraArgs, is shown as it is.
    assert rendered_weights(["--quantization", "compressed-tensors"]) == "compressed-tensors"


def test_prometheus_scrapes_the_routers_too(make_spec) -> None:
    """With the Prometheus Operator, one ServiceMonitor for the engines' Service and one for
    the routers' (their kvfleet_router_* series); none for routers that are not rendered."""
    monitors = {
        o["metadata"]["name"]: o["spec"]["selector"]["matchLabels"]
        for o in children(make_spec())
        if o["kind"] == "ServiceMonitor"
    }
    assert monitors == {
        "llama": {"kvfleet.io/deployment": "llama"},
        "llama-router": {"kvfleet.io/router": "llama"},
    }
    without = children(make_spec(routing={"enabled": False}))
    assert [o["metadata"]["name"] for o in without if o["kind"] == "ServiceMonitor"] == ["llama"]
    assert [
        o for o in children(make_spec(), service_monitor=False) if o["kind"] == "ServiceMonitor"
    ] == []
