"""Specs a careless or hostile user writes (found by driving the operator on the local control
plane with ~70 of them): each is refused where it is written, naming the field, instead of
rolling out pods that crash-loop or that run something else than the spec says."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError
from test_crd import _schema
from test_plan import WITH_LWS, plan

from kvfleet_operator.kinds.serving import MANAGED_FLAGS_MESSAGE
from kvfleet_operator.plan import ClusterFeatures
from kvfleet_operator.render_pod import engine_args

WITH_KEDA = ClusterFeatures(leader_worker_set=False, service_monitor=False, keda=True)


@pytest.mark.parametrize(
    ("extra", "flag", "field"),
    [
        (["--port", "9000"], "--port", "the engine port the Service and probes use"),
        (["--model=/etc"], "--model", "model.uri"),
        (["--quantization=fp8"], "--quantization", "quantization.weights"),
        (["--seed", "1", "--tensor-parallel-size", "8"], "--tensor-parallel-size",
         "parallelism.tensor"),
        (["--api-key", "sk-1"], "--api-key", "auth.apiKeySecretRef"),
        # float32 weights passed a plan of 17.46 of 21.6 GiB on an L4 (about 30 GiB alone)
        (["--dtype", "float32"], "--dtype", "the memory plan counts them"),
        (["--kv-cache-blocks=100000"], "--kv-cache-blocks", "engine.gpuMemoryUtilization"),
        (["--device=cpu"], "--device", "resources.accelerator"),
    ],
)  # fmt: skip
def test_extra_args_cannot_override_what_the_operator_sets(
    make_spec, extra: list[str], flag: str, field: str
) -> None:
    """Before, `--quantization=fp8` in extraArgs ran fp8 on an A100 past the capability check,
    `--port 9000` left the Service and probes on a port nobody listened on."""
    with pytest.raises(ValidationError) as error:
        make_spec(engine={"extraArgs": extra})
    message = str(error.value)
    assert f"engine.extraArgs: {flag} is set by the operator from" in message
    assert field in message
    # At admission kube-apiserver shows the same message (v1.37.2, `kubectl apply
    # --dry-run=server` with ["--seed", "1", "--quantization=fp8"]: "spec.engine.extraArgs:
    # Invalid value: engine.extraArgs: --quantization is set by the operator from
    # quantization.weights; set that instead"), built by the rule's messageExpression for the
    # first such argument: its string for one flag is a concatenation that reads the same in
    # Python (a JSON map is a CEL and a Python literal), so it is evaluated here.
    [rule] = _schema()["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"][
        "x-kubernetes-validations"
    ]
    assert rule["message"] == MANAGED_FLAGS_MESSAGE  # when the expression fails
    concatenation = rule["messageExpression"].split(".map(flag, ", 1)[1].removesuffix(")[0]")
    assert eval(concatenation, {"__builtins__": {}}, {"flag": flag}) in message
    # The same list: every flag the operator renders is refused by the CEL rule.
    spec = make_spec(
        parallelism={"tensor": 2}, sla={"ttftMs": 500, "tpotMs": 50},
        quantization={"weights": "fp8", "kvCache": "fp8"},
        engine={"maxQueuedRequests": 8, "maxQueuedTokens": 9000, "extraArgs": ["--seed", "1"]},
    )  # fmt: skip
    plan_ = plan(spec)
    rendered = [a for a in engine_args(spec, plan_, "/models/model") if a.startswith("--")]
    assert all(f'"{a}"' in rule["rule"] for a in rendered if a != "--seed")


def test_a_context_longer_than_the_models_positions_stalls(make_spec) -> None:
    """Llama 3.1 8B has 131,072 positions; the engine refuses more at start-up."""
    p = plan(make_spec(model={"maxModelLen": 1_000_000}, quantization={"kvCache": "fp8"}))
    [problem] = [problem for problem in p.problems if problem.reason == "ContextTooLong"]
    assert "model.maxModelLen=1000000 exceeds the model's 131072 positions" in problem.message
    assert plan(make_spec(model={"maxModelLen": 131_072})).ok


def test_a_block_size_the_engine_refuses_is_refused_here(make_spec) -> None:
    with pytest.raises(ValidationError, match="blockSize"):
        make_spec(engine={"blockSize": 3})
    assert make_spec(engine={"blockSize": 32}).engine.block_size == 32
    block = _schema()["properties"]["spec"]["properties"]["engine"]["properties"]["blockSize"]
    assert block["enum"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_replica_counts_stay_within_int32(make_spec) -> None:
    """maxReplicas 2^31 was admitted, then rendered into the HPA as -2147483648."""
    auto = {"controller": "HPA", "minReplicas": 1, "maxReplicas": 2**31,
            "targets": {"kvCacheUtilization": 0.8}}  # fmt: skip
    with pytest.raises(ValidationError, match="maxReplicas"):
        make_spec(replicas=None, autoscaling=auto)
    with pytest.raises(ValidationError, match="replicas"):
        make_spec(replicas=2**31)
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["replicas"]["maximum"] == 2**31 - 1
    assert spec["autoscaling"]["properties"]["maxReplicas"]["maximum"] == 2**31 - 1


def test_a_name_with_a_dot_or_a_leading_digit_is_refused_at_admission() -> None:
    """`my.model` was admitted; its Service was then refused (no dots), half the children built,
    and the operator retried it every 10 s for good. `8b-llama` named its Services 8b-llama and
    8b-llama-router, which Kubernetes before 1.36 refuses (a DNS-1035 label)."""
    rules = _schema()["x-kubernetes-validations"]
    [label] = [r for r in rules if "DNS-1123" in r["message"]]
    [letter] = [r for r in rules if "DNS-1035" in r["message"]]
    patterns = [re.search(r"matches\('(.+)'\)", r["rule"]).group(1) for r in (label, letter)]  # type: ignore[union-attr]

    def admitted(name: str) -> bool:
        return all(re.match(pattern, name) for pattern in patterns)

    assert admitted("llama-3-8b") and admitted("m0")
    for name in ("my.model", "Llama", "-x", "x-", "a_b", "8b-llama"):
        assert not admitted(name), name
    # The leading letter is checked when the object is created: one stored before the rule
    # stays editable (every update re-checks the root's rules).
    assert letter["optionalOldSelf"] is True and letter["rule"].startswith("oldSelf.hasValue() ||")


def test_a_served_model_name_holds_no_whitespace(make_spec) -> None:
    """It becomes an argument, a metric label and a log field: "llama\\n8b" was admitted."""
    for name in ("llama\n8b", "my model", " llama"):
        with pytest.raises(ValidationError, match="servedModelName"):
            make_spec(model={"servedModelName": name})
    assert make_spec(model={"servedModelName": "meta-llama/Llama-3.1-8B"}).model.served_model_name


def test_file_models_only_from_the_directories_the_operator_allows(make_spec) -> None:
    """A file:// model is a hostPath volume: `kvfleet operator --host-path-prefix /var/models`
    keeps users who may create InferenceDeployments from mounting any other node directory."""
    from kvfleet_operator.accelerators import resolve_accelerator
    from kvfleet_operator.model_catalog import model_architecture
    from kvfleet_operator.plan import ClusterFeatures, plan_deployment

    def reasons_for(uri: str, prefixes: tuple[str, ...] | None) -> list[str]:
        spec = make_spec(model={"uri": uri})
        p = plan_deployment(
            "llama", spec, resolve_accelerator("h100-80gb", {}), model_architecture(spec.model),
            ClusterFeatures(leader_worker_set=False, service_monitor=False),
            host_path_prefixes=prefixes,
        )  # fmt: skip
        return [problem.reason for problem in p.problems]

    allowed = ("/var/models",)
    assert reasons_for("file:///var/models/llama", allowed) == []
    assert reasons_for("file:///var/models", allowed) == []
    assert reasons_for("file:///etc/kubernetes", allowed) == ["HostPathNotAllowed"]
    assert reasons_for("file:///var/models2/llama", allowed) == ["HostPathNotAllowed"]
    assert reasons_for("file:///etc/kubernetes", None) == []  # no prefixes set: any
    assert reasons_for("hf://meta-llama/Llama-3.1-8B-Instruct", ()) == []


def test_the_step_budget_holds_a_full_batch(make_spec) -> None:
    """maxNumBatchedTokens 100 was admitted and went Ready; the engine refused to start
    ("max_num_batched_tokens must be >= max_num_seqs (256)") and the pods crash-looped."""
    with pytest.raises(ValidationError, match=r"maxNumBatchedTokens \(100\) must be >= "):
        make_spec(engine={"maxNumBatchedTokens": 100})
    assert make_spec(engine={"maxNumSeqs": 64, "maxNumBatchedTokens": 100}).engine


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ({"uri": "s3://models/llama", "revision": "v2"}, "model.revision"),
        ({"uri": "pvc://models/llama", "revision": "v2"}, "model.revision"),
        ({"uri": "pvc://models/llama", "credentialsSecret": {"name": "s"}},
         "model.credentialsSecret"),
        ({"uri": "file:///var/models/llama", "credentialsSecret": {"name": "s"}},
         "model.credentialsSecret"),
    ],
)  # fmt: skip
def test_fields_a_model_source_would_ignore_are_refused(make_spec, model, field) -> None:
    """`revision: v2` on an s3:// model was accepted and never used: the pods ran whatever the
    prefix held."""
    with pytest.raises(ValidationError, match=f"{field} applies to hf://"):
        make_spec(model={**model, "maxModelLen": 8192})


@pytest.mark.parametrize(
    ("behavior", "controller", "field"),
    [
        ({"panicThreshold": 5}, "HPA", "behavior.panicThreshold"),
        ({"tolerance": 0.3}, "KEDA", "behavior.tolerance"),
        ({"warmupSeconds": 600}, "HPA", "behavior.warmupSeconds"),
        ({"syncPeriodSeconds": 2}, "HPA", "behavior.syncPeriodSeconds"),
        ({"scaleDown": {"drainTimeoutSeconds": 5}}, "KEDA",
         "behavior.scaleDown.drainTimeoutSeconds"),
    ],
)  # fmt: skip
def test_behavior_an_external_autoscaler_would_ignore_stalls(
    make_spec, behavior, controller, field
) -> None:
    """controller HPA dropped panicThreshold, tolerance, warm-up... from the rendered HPA
    without a word."""
    autoscaling = {
        "controller": controller, "maxReplicas": 4, "targets": {"kvCacheUtilization": 0.7},
        "behavior": behavior,
        **({"prometheus": {"url": "http://prometheus:9090"}} if controller == "KEDA" else {}),
    }  # fmt: skip
    p = plan(make_spec(replicas=None, autoscaling=autoscaling), cluster=WITH_KEDA)
    assert [(x.reason, x.message.split(" is read")[0]) for x in p.problems] == [
        ("InvalidAutoscaling", f"autoscaling.{field}")
    ]
    # What the controller carries is fine, and so is a default written out.
    carried = {"scaleDown": {"stabilizationWindowSeconds": 120}, "panicThreshold": 2.0}
    spec = make_spec(replicas=None, autoscaling={**autoscaling, "behavior": carried})
    assert plan(spec, cluster=WITH_KEDA).ok


def test_keda_carries_the_sync_period_and_window(make_spec) -> None:
    autoscaling = {
        "controller": "KEDA", "maxReplicas": 4, "targets": {"kvCacheUtilization": 0.7},
        "prometheus": {"url": "http://prometheus:9090"},
        "behavior": {"syncPeriodSeconds": 10, "stableWindowSeconds": 120, "panicWindowSeconds": 20},
    }  # fmt: skip
    p = plan(make_spec(replicas=None, autoscaling=autoscaling), cluster=WITH_KEDA)
    assert [x.message.split(" is read")[0] for x in p.problems] == [
        "autoscaling.behavior.panicWindowSeconds"
    ]


def test_cpu_and_memory_take_a_whole_number_as_pods_do(make_spec) -> None:
    """`cpu: 8` (unquoted, as in any pod spec) was refused: must be of type string."""
    spec = make_spec(resources={"accelerator": "h100-80gb", "cpu": 8, "memory": "64Gi"})
    assert spec.resources.cpu == "8"
    for bad in ("two", -1, True, 8.5):
        with pytest.raises(ValidationError, match="cpu"):
            make_spec(resources={"accelerator": "h100-80gb", "cpu": bad})
    cpu = _schema()["properties"]["spec"]["properties"]["resources"]["properties"]["cpu"]
    assert cpu["x-kubernetes-int-or-string"] is True and "type" not in cpu
    assert cpu["anyOf"] == [{"type": "integer"}, {"type": "string"}] and cpu["minimum"] == 0


@pytest.mark.parametrize(
    "override",
    [
        {"model": {"uri": "hf://org/private/x.gguf",
                   "credentialsSecret": {"name": "../../kube-system/secrets/hf-token"}}},
        {"model": {"credentialsSecret": {"name": "Bad Name"}}},
        {"auth": {"apiKeySecretRef": {"name": "My_Secret/x", "key": "k"}}},
        {"auth": {"apiKeySecretRef": {"name": "", "key": "k"}}},
    ],
)  # fmt: skip
def test_secret_names_are_object_names(make_spec, override) -> None:
    """A credentialsSecret of "../../kube-system/secrets/hf-token" made the operator read
    kube-system's Secret (the client resolved the dots in the path) and plan from a private
    header with it; other names reached the pod template and were refused there."""
    with pytest.raises(ValidationError, match="should match pattern"):
        make_spec(**override)
    assert make_spec(model={"credentialsSecret": {"name": "hf-token.v2"}}).model


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"rollout": {"startupTimeoutSeconds": 2147483600}}, "startupTimeoutSeconds"),
        ({"rollout": {"maxSurge": 2**31}}, "maxSurge"),
        ({"engine": {"image": " repo/img:1 "}}, "image"),
        ({"routing": {"image": "repo/router 1"}}, "image"),
        ({"resources": {"sharedMemory": " 9Gi "}}, "sharedMemory"),
        ({"resources": {"sharedMemory": "16K"}}, "sharedMemory"),
    ],
)  # fmt: skip
def test_values_kubernetes_would_refuse_in_a_child_are_refused_here(
    make_spec, override, field
) -> None:
    """Each was admitted and rendered into a child the API server refused (an int32 field past
    its range, an image with spaces, a quantity with spaces): ApplyRejected or pods refused
    instead of the field named at admission."""
    with pytest.raises(ValidationError) as error:
        make_spec(**override)
    assert field in str(error.value)


@pytest.mark.parametrize(
    ("text", "gib"),
    [("10e9", 10e9 / 2**30), ("9.Gi", 9.0), ("1Ei", 2.0**30), ("32Gi", 32.0),
     ("1e99999", float("inf")), ("1e9999999", float("inf")), ("0e99999", 0.0),
     ("500m", 0.5 / 2**30), ("2E", 2e18 / 2**30), ("2E3", 2e3 / 2**30)],
)  # fmt: skip
def test_shared_memory_takes_every_kubernetes_quantity(make_spec, text, gib) -> None:
    """10e9 and 9.Gi were valid quantities the operator stalled on (InvalidSharedMemory)."""
    from kvfleet_operator.topology import quantity_bytes

    spec = make_spec(parallelism={"tensor": 2}, resources={"sharedMemory": text})
    assert plan(spec).ok
    assert quantity_bytes(spec.resources.shared_memory) == pytest.approx(gib * 2**30)


@pytest.mark.parametrize(
    "targets",
    [{"kvCacheUtilization": 0.0004}, {"waitingRequestsPerReplica": 0.0001},
     {"generationTokenRate": {"tokensPerSecond": 0.0002}}],
)  # fmt: skip
def test_autoscaling_targets_below_a_milli_unit_are_refused(make_spec, targets) -> None:
    """kvCacheUtilization 0.0004 rendered an HPA target of "0m", which the API server refuses."""
    autoscaling = {"controller": "HPA", "maxReplicas": 4, "targets": targets}
    with pytest.raises(ValidationError, match=r"greater than or equal to 0\.001"):
        make_spec(replicas=None, autoscaling=autoscaling)


def test_statefulset_groups_are_bounded(make_spec) -> None:
    """replicas 50,000 of two-node replicas rendered 50,000 StatefulSets on every pass: 9 s and
    768 MiB, past the operator pod's memory limit."""
    groups = {"model": {"uri": "hf://meta-llama/Llama-3.1-405B-Instruct"},
              "parallelism": {"tensor": 8, "pipeline": 2}}  # fmt: skip
    p = plan(make_spec(**groups, replicas=50_000))
    assert [(x.reason, x.message.split(":")[0]) for x in p.problems] == [
        ("TooManyReplicas", "replicas=50000")
    ]
    assert plan(make_spec(**groups, replicas=512)).ok
    assert plan(make_spec(**groups, replicas=50_000), WITH_LWS).ok  # one LeaderWorkerSet


@pytest.mark.parametrize(
    "resource", ["requests.nvidia.com/gpu", "kubernetes.io/gpu", "gpu.kubernetes.io/a100"]
)
def test_a_profile_names_an_extended_resource_pods_can_request(resource: str) -> None:
    """resourceName requests.nvidia.com/gpu passed the profile's pattern; every pod asking for
    it was refused ("doesn't follow extended resource name standard")."""
    from kvfleet_operator.kinds.accelerator import RESOURCE_NAME_MESSAGE, RESOURCE_NAME_RULE
    from kvfleet_operator.models import AcceleratorProfileSpec

    profile = {"memoryGiB": 80, "computeCapability": "9.0"}
    with pytest.raises(ValidationError, match=re.escape(RESOURCE_NAME_MESSAGE)):
        AcceleratorProfileSpec.model_validate({**profile, "resourceName": resource})
    assert AcceleratorProfileSpec.model_validate({**profile, "resourceName": "amd.com/gpu"})
    # The API server checks the same at admission (the CRD's rule).
    from kvfleet_operator.crd import accelerator_profile_crd

    schema = accelerator_profile_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = schema["properties"]["spec"]["properties"]["resourceName"]["x-kubernetes-validations"]
    assert {"rule": RESOURCE_NAME_RULE, "message": RESOURCE_NAME_MESSAGE} in rules
