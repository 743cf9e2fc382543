"""Planning: topology, memory, hardware and engine checks, without a cluster."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from pydantic import ValidationError

from kvfleet_operator import engine_features
from kvfleet_operator.accelerators import BUILTIN_ACCELERATORS, resolve_accelerator
from kvfleet_operator.gguf_header import GGUFUnavailable, parse_gguf_header
from kvfleet_operator.model_catalog import MODEL_CATALOG, model_architecture, reads_gguf_header
from kvfleet_operator.models import AcceleratorProfileSpec, KVCacheQuantization, WeightQuantization
from kvfleet_operator.plan import ClusterFeatures, plan_deployment, weight_bytes

NO_EXTRAS = ClusterFeatures(leader_worker_set=False, service_monitor=False)
WITH_LWS = ClusterFeatures(leader_worker_set=True, service_monitor=False)


def plan(spec, cluster=NO_EXTRAS, profiles=None):
    profile = resolve_accelerator(spec.resources.accelerator, profiles or {})
    return plan_deployment("llama", spec, profile, model_architecture(spec.model), cluster)


def reasons(p) -> list[str]:
    return [problem.reason for problem in p.problems]


def test_llama_8b_on_one_h100_fits_in_one_pod(make_spec) -> None:
    p = plan(make_spec())
    assert p.ok and p.served_model_name == "llama"
    assert p.topology.kind == "Deployment"
    assert (p.topology.gpus_per_replica, p.topology.pods_per_replica) == (1, 1)
    # 8.03e9 params × 2 bytes = 14.96 GiB; KV = 2 × 32 × 8 × 128 × 2 B × 8192 = 1 GiB.
    assert p.memory.weights_gib == pytest.approx(14.96, abs=0.01)
    assert p.memory.kv_cache_gib == pytest.approx(1.0, abs=0.01)
    assert p.memory.available_gib == pytest.approx(72.0)
    assert p.memory.fits
    # 120 s + 10 s per GiB of weights in the pod.
    assert p.startup_timeout_seconds == 120 + 150


def test_served_model_name_from_spec(make_spec) -> None:
    assert plan(make_spec(model={"servedModelName": "chat"})).served_model_name == "chat"


def test_model_too_large_is_insufficient_gpu_memory_with_numbers(make_spec) -> None:
    spec = make_spec(
        model={"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"}, resources={"accelerator": "l4"}
    )
    p = plan(spec)
    assert reasons(p) == ["InsufficientGPUMemory"]
    message = p.problems[0].message
    assert (
        "needs 135.42 GiB per GPU (weights 131.42 + KV cache 2.5" in message
        and "l4 offers 21.6 GiB" in message
    )


def test_kv_cache_scales_with_length_and_concurrency(make_spec) -> None:
    p = plan(make_spec(model={"maxModelLen": 131072}, sla={"concurrentSequences": 4}))
    assert p.memory.kv_cache_gib == pytest.approx(64.0)
    assert reasons(p)[0] == "InsufficientGPUMemory"


# Llama-3.1-8B per block, (in, out): q (4096, 4096), k and v (4096, 1024), o (4096, 4096),
# gate and up (4096, 14336), down (14336, 4096): 218,103,808 weights; 32 blocks 6,979,321,856.
# The other 1,050,939,392 parameters (embeddings, lm head, norms) stay bf16: 2,101,878,784 B.
LLAMA_8B_LINEAR = 6_979_321_856
LLAMA_8B_REST_BYTES = 2 * 1_050_939_392
LLAMA_8B_OUT_COLUMNS = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)  # 1,376,256


@pytest.mark.parametrize(
    ("weights", "expected_bytes"),
    [
        ("none", 2 * 8_030_261_248),
        # 1 byte codes + one float32 scale per output column
        ("int8", LLAMA_8B_LINEAR + 4 * LLAMA_8B_OUT_COLUMNS + LLAMA_8B_REST_BYTES),
        ("fp8", LLAMA_8B_LINEAR + 4 * LLAMA_8B_OUT_COLUMNS + LLAMA_8B_REST_BYTES),
        # 0.5 byte codes + fp16 scale and fp16 offset per 128 inputs: 0.53125 bytes per weight
        ("int4-awq", LLAMA_8B_LINEAR * 0.53125 + LLAMA_8B_REST_BYTES),
        ("int4-gptq", LLAMA_8B_LINEAR * 0.53125 + LLAMA_8B_REST_BYTES),
    ],
)
def test_weights_are_the_engines_bytes_per_format(make_spec, weights, expected_bytes) -> None:
    assert weight_bytes(MODEL_CATALOG["llama-3.1-8b"], weights) == expected_bytes
    p = plan(make_spec(quantization={"weights": weights}))
    assert p.ok, p.problems
    assert p.memory.weights_gib == round(expected_bytes / 1024**3, 2)


def test_quantized_weights_in_gib_and_startup(make_spec) -> None:
    gib = {w: plan(make_spec(quantization={"weights": w})).memory.weights_gib
           for w in ("none", "int8", "fp8", "int4-awq")}  # fmt: skip
    assert gib == {"none": 14.96, "int8": 8.46, "fp8": 8.46, "int4-awq": 5.41}
    # Loading time follows the bytes read: 120 s + 10 s per GiB.
    p = plan(make_spec(quantization={"weights": "int4-awq"}))
    assert p.startup_timeout_seconds == 120 + math.ceil(10 * 5.41)


def test_without_the_mlp_width_every_parameter_counts_as_quantized(make_spec) -> None:
    hints = {
        "numParameters": 1_000_000_000, "numLayers": 16, "numAttentionHeads": 16,
        "numKeyValueHeads": 4, "headDim": 128,
    }  # fmt: skip
    numbers = make_spec(model={"uri": "pvc://models/x", "hints": hints}).model.hints
    assert numbers.hidden == 2048  # heads × head dim
    assert weight_bytes(numbers, "int4-awq") == 531_250_000  # 0.5 + 4 / 128 per parameter
    assert weight_bytes(numbers, "int8") == 1_000_000_000 * (1 + 4 / 2048)
    assert weight_bytes(numbers, "none") == 2_000_000_000
    # Hints with the MLP width split the linears from the 16-bit rest, as the catalog does.
    full = {
        "numParameters": 8_030_261_248, "numLayers": 32, "numAttentionHeads": 32,
        "numKeyValueHeads": 8, "headDim": 128, "hiddenSize": 4096, "intermediateSize": 14336,
    }  # fmt: skip
    numbers = make_spec(model={"uri": "pvc://models/x", "hints": full}).model.hints
    assert weight_bytes(numbers, "int4-awq") == LLAMA_8B_LINEAR * 0.53125 + LLAMA_8B_REST_BYTES


@pytest.mark.parametrize("kv_cache", ["fp8", "int8"])
def test_quantized_kv_cache_halves_the_cache_plus_its_scales(make_spec, kv_cache: str) -> None:
    long = {"model": {"maxModelLen": 131072}, "sla": {"concurrentSequences": 8}}
    auto = plan(make_spec(**long)).memory
    fp8 = plan(make_spec(**long, quantization={"kvCache": kv_cache})).memory
    # 2 × 32 layers × 8 KV heads × 128 × 2 B × 131072 × 8 = 128 GiB; e4m3 or int8: 1 B per
    # element and a bfloat16 scale per (token, KV head) for K and V: × (128 + 2) / 256 = 65 GiB.
    assert (auto.kv_cache_gib, fp8.kv_cache_gib) == (128.0, 65.0)
    assert fp8.required_gib == pytest.approx(fp8.weights_gib + 65.0 + 1.5, abs=0.01)


def test_fp8_needs_compute_capability_8_9(make_spec) -> None:
    both = {"weights": "fp8", "kvCache": "fp8"}
    p = plan(make_spec(quantization=both, resources={"accelerator": "a100-80gb"}))
    assert reasons(p) == ["UnsupportedQuantization", "UnsupportedQuantization"]
    a100 = "a100-80gb (NVIDIA-A100-SXM4-80GB) has 8.0"
    assert [problem.message for problem in p.problems] == [
        f"quantization.weights=fp8 needs compute capability >= 8.9; {a100}",
        f"quantization.kvCache=fp8 needs compute capability >= 8.9; {a100} "
        "(quantization.kvCache=int8 runs on any GPU)",
    ]
    # int4 and int8 run on Ampere (an int8 KV cache too); fp8 from Ada (L4, 8.9) and Hopper on.
    for weights in ("int8", "int4-awq", "int4-gptq"):
        assert plan(make_spec(quantization={"weights": weights, "kvCache": "int8"},
                              resources={"accelerator": "a100-80gb"})).ok  # fmt: skip
    for accelerator in ("l4", "h100-80gb", "b200"):
        spec = make_spec(
            model={"maxModelLen": 4096}, quantization=both, resources={"accelerator": accelerator}
        )
        assert plan(spec).ok, accelerator
    # A cluster profile without a product label is named by its own name.
    ampere = AcceleratorProfileSpec(memory_gib=24, compute_capability="8.6")
    spec = make_spec(quantization={"kvCache": "fp8"}, resources={"accelerator": "lab-a10"})
    p = plan(spec, profiles={"lab-a10": ampere})
    assert p.problems[0].message.endswith(
        "lab-a10 has 8.6 (quantization.kvCache=int8 runs on any GPU)"
    )


def test_every_crd_quantization_is_served(make_spec) -> None:
    for weights in typing.get_args(WeightQuantization):
        for kv_cache in typing.get_args(KVCacheQuantization):
            spec = make_spec(quantization={"weights": weights, "kvCache": kv_cache})
            assert plan(spec).ok, (weights, kv_cache)


def test_heads_must_divide_by_tensor_parallel(make_spec) -> None:
    # Qwen2.5-7B: 28 query heads, 4 KV heads.
    spec = make_spec(model={"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}, parallelism={"tensor": 8})
    p = plan(spec)
    assert reasons(p)[0] == "InvalidParallelism"
    assert "does not divide the model's 28 attention heads" in p.problems[0].message


def test_gpus_per_replica_is_tensor_times_pipeline(make_spec) -> None:
    p = plan(make_spec(parallelism={"tensor": 4, "pipeline": 2}))
    assert p.topology.gpus_per_replica == 8 and p.topology.kind == "Deployment"
    assert p.memory.weights_gib == pytest.approx(14.96 / 8, abs=0.01)


def test_replica_larger_than_a_node_is_a_group_of_pods(make_spec) -> None:
    spec = make_spec(
        model={"uri": "hf://meta-llama/Llama-3.1-405B-Instruct"},
        parallelism={"tensor": 8, "pipeline": 2},
    )
    # Without the LeaderWorkerSet API: one StatefulSet per replica, which any cluster runs.
    p = plan(spec)
    assert p.ok, p.problems
    assert p.topology.kind == "StatefulSet"
    assert (p.topology.pods_per_replica, p.topology.gpus_per_pod) == (2, 8)
    assert (p.topology.nodes_per_replica, p.topology.gpus_per_replica) == (2, 16)
    # 405.85e9 params × 2 bytes / 16 GPUs = 47.25 GiB per GPU.
    assert p.memory.weights_gib == pytest.approx(47.25, abs=0.01) and p.memory.fits
    with_lws = plan(spec, WITH_LWS)
    assert with_lws.ok and with_lws.topology.kind == "LeaderWorkerSet"
    assert with_lws.topology.pods_per_replica == 2


@pytest.mark.parametrize(
    ("tensor", "pipeline", "per_node", "kind", "pods", "gpus_per_pod"),
    [
        (1, 1, 8, "Deployment", 1, 1),
        (8, 1, 8, "Deployment", 1, 8),
        (2, 4, 8, "Deployment", 1, 8),
        (8, 2, 8, "StatefulSet", 2, 8),
        (4, 3, 8, "StatefulSet", 2, 6),  # 12 ranks: 2 nodes of 6
        (8, 1, 4, "StatefulSet", 2, 4),
        (2, 2, 1, "StatefulSet", 4, 1),
        (1, 2, 1, "StatefulSet", 2, 1),
    ],
)
def test_ranks_split_evenly_over_the_fewest_nodes(
    make_spec, tensor, pipeline, per_node, kind, pods, gpus_per_pod
) -> None:
    profile = BUILTIN_ACCELERATORS["h100-80gb"].model_copy(update={"devices_per_node": per_node})
    p = plan(
        make_spec(parallelism={"tensor": tensor, "pipeline": pipeline}),
        profiles={"h100-80gb": profile},
    )
    assert p.ok, p.problems
    topology = p.topology
    assert (topology.kind, topology.pods_per_replica, topology.gpus_per_pod) == (
        kind, pods, gpus_per_pod
    )  # fmt: skip
    assert topology.gpus_per_replica == tensor * pipeline == pods * gpus_per_pod


def test_a_world_that_does_not_split_evenly_over_nodes_names_the_numbers(make_spec) -> None:
    profile = BUILTIN_ACCELERATORS["h100-80gb"].model_copy(update={"devices_per_node": 4})
    p = plan(make_spec(parallelism={"tensor": 2, "pipeline": 5}), profiles={"h100-80gb": profile})
    assert reasons(p) == ["InvalidParallelism"]
    assert p.problems[0].message == (
        "parallelism.tensor × parallelism.pipeline = 2 × 5 = 10 GPUs needs 3 nodes of 4 devices "
        "(h100-80gb), but 10 ranks do not split evenly over 3 nodes (every node runs the same "
        "number of ranks)"
    )


def test_pipeline_larger_than_the_layers_is_refused(make_spec) -> None:
    # Llama 3.2 1B: 16 layers.
    spec = make_spec(model={"uri": "hf://meta-llama/Llama-3.2-1B"}, parallelism={"pipeline": 16})
    assert plan(spec).ok
    hints = {
        "numParameters": 1_000_000, "numLayers": 4, "numAttentionHeads": 8,
        "numKeyValueHeads": 2, "headDim": 16,
    }  # fmt: skip
    p = plan(make_spec(model={"uri": "pvc://m/tiny", "hints": hints}, parallelism={"pipeline": 8}))
    assert reasons(p) == ["InvalidParallelism"]
    assert p.problems[0].message == "parallelism.pipeline=8 exceeds the model's 4 layers"


def test_tensor_size_must_divide_the_mlp_width(make_spec) -> None:
    """The engine splits the MLP evenly over the ranks and refuses at start-up otherwise; the
    plan said Ready and the pods crash-looped."""
    hints = {
        "numParameters": 8_000_000_000, "numLayers": 32, "numAttentionHeads": 32,
        "numKeyValueHeads": 8, "headDim": 128, "maxPositionEmbeddings": 8192,
        "intermediateSize": 14335,
    }  # fmt: skip
    p = plan(make_spec(model={"uri": "pvc://m/odd", "hints": hints}, parallelism={"tensor": 2}))
    assert reasons(p) == ["InvalidParallelism"]
    assert p.problems[0].message.startswith(
        "parallelism.tensor=2 does not divide the model's MLP width (intermediateSize 14335)"
    )
    even = {**hints, "intermediateSize": 14336}
    assert plan(
        make_spec(model={"uri": "pvc://m/odd", "hints": even}, parallelism={"tensor": 2})
    ).ok


def test_hints_with_more_kv_heads_than_query_heads_are_refused(make_spec) -> None:
    hints = {
        "numParameters": 1_000_000, "numLayers": 4, "numAttentionHeads": 8,
        "numKeyValueHeads": 32, "headDim": 16, "maxPositionEmbeddings": 2048,
    }  # fmt: skip
    with pytest.raises(ValidationError, match="numAttentionHeads must be a multiple of num"):
        make_spec(model={"uri": "pvc://m/tiny", "hints": hints})


def test_a_context_the_model_refuses_is_named_before_the_memory_it_would_take(make_spec) -> None:
    """maxModelLen 10,000,000 was reported as InsufficientGPUMemory, hiding the cause."""
    p = plan(make_spec(model={"maxModelLen": 10_000_000}))
    assert reasons(p) == ["ContextTooLong", "InsufficientGPUMemory"]


def test_tensor_size_against_gguf_header_heads(make_spec, write_gguf) -> None:
    """The head count of an hf:// GGUF file's header checks the tensor size."""
    gguf = write_gguf(with_data=False, heads=4, kv_heads=2, context=8192)
    header = parse_gguf_header(gguf.read_bytes())
    spec = make_spec(model={"uri": GGUF_URI}, parallelism={"tensor": 8})
    p = plan_deployment(
        "llama", spec, resolve_accelerator("h100-80gb", {}),
        model_architecture(spec.model, header), NO_EXTRAS,
    )  # fmt: skip
    assert reasons(p) == ["InvalidParallelism"]
    assert p.problems[0].message == (
        "parallelism.tensor=8 does not divide the model's 4 attention heads"
    )
    spec = make_spec(model={"uri": GGUF_URI}, parallelism={"tensor": 4})
    p = plan_deployment(
        "llama", spec, resolve_accelerator("h100-80gb", {}),
        model_architecture(spec.model, header), NO_EXTRAS,
    )  # fmt: skip
    assert p.ok, p.problems


def test_external_autoscalers_cannot_scale_statefulset_groups(make_spec) -> None:
    autoscaling = {
        "controller": "HPA", "maxReplicas": 4, "targets": {"kvCacheUtilization": 0.7},
    }  # fmt: skip
    spec = make_spec(
        parallelism={"tensor": 8, "pipeline": 2}, replicas=None, autoscaling=autoscaling
    )
    assert reasons(plan(spec)) == ["GroupAutoscalingUnavailable"]
    assert "autoscaling.controller=HPA scales the replicas of one object" in (
        plan(spec).problems[0].message
    )
    assert plan(spec, WITH_LWS).ok  # an HPA scales a LeaderWorkerSet's groups


def test_a_name_too_long_for_the_groups_statefulsets_stalls(make_spec) -> None:
    """Replicas of several nodes run as StatefulSets named <name>-group-<index>; past 52
    characters their pods cannot be created (the controller-revision-hash label passes 63), so
    the plan says so instead of rolling out pods that never start."""
    spec = make_spec(parallelism={"tensor": 8, "pipeline": 2}, replicas=10)
    profile = resolve_accelerator(spec.resources.accelerator, {})
    architecture = model_architecture(spec.model)
    for cluster in (NO_EXTRAS, WITH_LWS):
        fits = plan_deployment("m" * 44, spec, profile, architecture, cluster)
        assert fits.ok, fits.problems
        long = plan_deployment("m" * 45, spec, profile, architecture, cluster)
        assert reasons(long) == ["NameTooLong"]
        assert "(45 characters)" in long.problems[0].message
        assert "use a name of at most 44 characters" in long.problems[0].message
    one_node = make_spec(replicas=10)  # a Deployment: no StatefulSet names
    assert plan_deployment("m" * 52, one_node, profile, architecture, NO_EXTRAS).ok


def test_unsupported_tensor_size_is_feature_unavailable(make_spec) -> None:
    p = plan(make_spec(parallelism={"tensor": 16}), WITH_LWS)
    assert reasons(p) == ["FeatureUnavailable"]
    assert p.problems[0].message == (
        "parallelism.tensor=16: the engine serves tensor parallel size 1 or 2 or 4 or 8 only "
        "for now"
    )


def test_pipeline_stages_are_served(make_spec) -> None:
    p = plan(make_spec(parallelism={"tensor": 4, "pipeline": 2}))
    assert p.ok, p.problems
    assert (p.topology.tensor, p.topology.pipeline, p.topology.gpus_per_replica) == (4, 2, 8)


def test_engine_feature_gate_names_each_field(make_spec, monkeypatch: pytest.MonkeyPatch) -> None:
    # An engine without tensor parallelism, quantized weights or an e4m3 KV cache: the same
    # gate holds them back.
    monkeypatch.setattr(engine_features, "WEIGHT_QUANTIZATIONS", frozenset({"none"}))
    monkeypatch.setattr(engine_features, "KV_CACHE_QUANTIZATIONS", frozenset({"auto"}))
    quantized = {"weights": "int4-awq", "kvCache": "fp8"}
    monkeypatch.setattr(engine_features, "TENSOR_PARALLEL_SIZES", frozenset({1}))
    p = plan(make_spec(parallelism={"tensor": 2}, quantization=quantized))
    assert reasons(p) == ["FeatureUnavailable"] * 3
    assert [problem.message for problem in p.problems] == [
        "parallelism.tensor=2: the engine serves tensor parallel size 1 only for now",
        "quantization.weights=int4-awq: the engine serves none weights only for now",
        "quantization.kvCache=fp8: the engine keeps the KV cache as auto only for now",
    ]


def test_unknown_accelerator_and_custom_profile(make_spec) -> None:
    spec = make_spec(resources={"accelerator": "mi300x"})
    assert reasons(plan(spec)) == ["UnknownAccelerator"]
    custom = AcceleratorProfileSpec(
        resource_name="amd.com/gpu", memory_gib=192, compute_capability="9.4"
    )
    p = plan(spec, profiles={"mi300x": custom})
    assert p.ok and p.memory.available_gib == pytest.approx(172.8)


def test_profile_object_overrides_builtin(make_spec) -> None:
    override = BUILTIN_ACCELERATORS["h100-80gb"].model_copy(update={"devices_per_node": 4})
    p = plan(make_spec(parallelism={"tensor": 8}), WITH_LWS, {"h100-80gb": override})
    assert p.topology.kind == "LeaderWorkerSet" and p.topology.pods_per_replica == 2


def test_unknown_model_plans_without_memory_and_hints_fill_in(make_spec) -> None:
    spec = make_spec(model={"uri": "pvc://models/my-finetune"})
    p = plan(spec)
    assert p.ok and p.memory is None and p.startup_timeout_seconds == 900
    hints = {
        "numParameters": 3_000_000_000, "numLayers": 26, "numAttentionHeads": 16,
        "numKeyValueHeads": 8, "headDim": 128,
    }  # fmt: skip
    p = plan(make_spec(model={"uri": "pvc://models/my-finetune", "hints": hints}))
    assert p.memory.weights_gib == pytest.approx(5.59, abs=0.01)


GGUF_URI = "hf://bartowski/Meta-Llama-3.1-8B-Instruct-GGUF/Meta-Llama-3.1-8B-Instruct-Q4_1.gguf"


def llama_8b_gguf_header(write_gguf):
    """The header of a Llama-3.1-8B-shaped GGUF file (Q4_1 / Q4_K / Q6_K / Q8_0 / F16 tensors)."""
    path = write_gguf(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, context=131072,
        with_data=False,
    )  # fmt: skip
    summary = parse_gguf_header(path.read_bytes())
    assert summary is not None
    return summary


# Llama 3.1 8B as conftest's header lays it out, in the engine's bytes on a GPU: per block, q/k/v
# (Q4_K, Q4_K, Q6_K: mixed kinds, one fused layer) in bf16, o (Q4_K) and gate/up (Q4_1) as int4
# 0.625, down (Q8_0) as int8 1.0625, 2 norms in bf16; the Q4_1 embedding and F16 output in bf16.
_BLOCK_BYTES = (
    (4096 + 2 * 1024) * 4096 * 2
    + 4096 * 4096 * 0.625
    + 2 * 14336 * 4096 * 0.625
    + 4096 * 14336 * 1.0625
    + 2 * 4096 * 2
)
LLAMA_8B_GGUF_ENGINE_BYTES = 32 * _BLOCK_BYTES + 2 * 128256 * 4096 * 2 + 4096 * 2


def test_gguf_header_gives_the_numbers_and_the_engines_bytes(make_spec, write_gguf) -> None:
    header = llama_8b_gguf_header(write_gguf)
    assert header.num_parameters == 8_030_261_248  # the catalog's Llama 3.1 8B, counted
    # 4- to 8-bit blocks and an F16 output layer: about 0.8 bytes per parameter, not 2 (bf16).
    assert 0.55 < header.weight_bytes / header.num_parameters < 0.85
    p = plan_with(make_spec(model={"uri": GGUF_URI}), header)
    assert p.ok and p.memory.source == "ggufHeader"
    # The engine keeps the Q8_0 / Q4_x linears quantized and dequantizes the rest to bf16: more
    # than the file's bytes, less than bf16's 14.96 GiB.
    assert p.memory.weights_gib == round(LLAMA_8B_GGUF_ENGINE_BYTES / 1024**3, 2)
    assert header.weight_bytes / 1024**3 < p.memory.weights_gib < 14.96 / 1.5
    assert p.memory.kv_cache_gib == pytest.approx(1.0)
    assert p.startup_timeout_seconds == 120 + math.ceil(10 * p.memory.weights_gib)
    # Numbers that do not come from a GGUF header keep parameters × bytes per weight.
    assert plan(make_spec()).memory.weights_gib == pytest.approx(14.96, abs=0.01)


def test_gguf_with_a_weights_quantization_is_unavailable(make_spec, write_gguf) -> None:
    """The engine refuses --quantization for a GGUF file: the file's tensors set the format."""
    header = llama_8b_gguf_header(write_gguf)
    p = plan_with(make_spec(model={"uri": GGUF_URI}, quantization={"weights": "int8"}), header)
    assert reasons(p) == ["FeatureUnavailable"]
    assert "quantization.weights=int8: a GGUF file's tensors keep their own formats" in (
        p.problems[0].message
    )


def test_gguf_weights_count_2_bytes_when_the_engine_dequantizes_them(
    make_spec, write_gguf, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_features, "GGUF_WEIGHTS_STAY_QUANTIZED", False)
    p = plan_with(make_spec(model={"uri": GGUF_URI}), llama_8b_gguf_header(write_gguf))
    assert p.memory.source == "ggufHeader"
    catalog = plan(make_spec()).memory
    assert p.memory.model_dump(exclude={"source"}) == catalog.model_dump(exclude={"source"})


def test_memory_plan_names_its_source(make_spec) -> None:
    assert plan(make_spec()).memory.source == "catalog"
    hints = {
        "numParameters": 8_000_000_000, "numLayers": 32, "numAttentionHeads": 32,
        "numKeyValueHeads": 8, "headDim": 128,
    }  # fmt: skip
    assert plan(make_spec(model={"hints": hints})).memory.source == "hints"
    # Hints win over the header: the operator does not read it then.
    spec = make_spec(model={"uri": GGUF_URI, "hints": hints})
    assert not reads_gguf_header(spec.model) and plan(spec).memory.source == "hints"
    assert reads_gguf_header(make_spec(model={"uri": GGUF_URI}).model)


@pytest.mark.parametrize(
    "uri",
    [
        "pvc://models/llama/Llama-3.1-8B-Instruct-Q4_1.gguf",
        "s3://models/llama/Llama-3.1-8B-Instruct-Q4_1.gguf",
        "file:///var/models/Llama-3.1-8B-Instruct-Q4_1.gguf",
    ],
)
def test_gguf_the_operator_cannot_read_falls_back_to_hints(make_spec, uri: str) -> None:
    spec = make_spec(model={"uri": uri})
    assert not reads_gguf_header(spec.model)
    p = plan(spec)
    scheme = uri.split("://")[0]
    assert p.ok and p.memory is None and p.startup_timeout_seconds == 900
    assert p.memory_unknown_reason == (
        f"the operator reads GGUF headers of hf:// files only, not {scheme}://: set model.hints"
    )
    hints = {
        "numParameters": 8_030_261_248, "numLayers": 32, "numAttentionHeads": 32,
        "numKeyValueHeads": 8, "headDim": 128,
    }  # fmt: skip
    p = plan(make_spec(model={"uri": uri, "hints": hints}))
    assert p.memory.source == "hints" and p.memory.weights_gib == pytest.approx(14.96, abs=0.01)


def test_unreadable_split_or_incomplete_headers_say_why(make_spec, write_gguf) -> None:
    spec = make_spec(model={"uri": GGUF_URI})
    unread = plan_with(spec, GGUFUnavailable("GET https://huggingface.co/...: HTTP 401"))
    assert unread.ok and unread.memory is None
    assert unread.memory_unknown_reason == (
        f"the GGUF header of {GGUF_URI} could not be read: GET https://huggingface.co/...: "
        "HTTP 401; set model.hints"
    )
    header = parse_gguf_header(write_gguf(metadata={"split.count": 3}).read_bytes())
    split = plan_with(spec, header)
    assert split.memory is None and "one of 3 split GGUF files" in split.memory_unknown_reason
    no_layers = dataclasses.replace(header, split_count=1, block_count=None, head_dim=None)
    assert plan_with(spec, no_layers).memory_unknown_reason == (
        f"the GGUF header of {GGUF_URI} has no llama.block_count, llama.attention.key_length or "
        "llama.embedding_length: set model.hints"
    )
    assert "was not read" in plan(spec).memory_unknown_reason


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        # anyone can publish a header: numbers no model has are a reason, not a crash
        (
            {"head_count": 32, "head_count_kv": 5},
            "numAttentionHeads must be a multiple of numKeyValueHeads",
        ),
        ({"head_dim": 0}, "has no llama.attention.key_length or llama.embedding_length"),
        ({"block_count": 0}, "has no llama.block_count"),
        ({"context_length": -5}, "greater than or equal to 1"),
    ],
)
def test_a_header_with_impossible_numbers_is_a_reason_not_a_crash(
    make_spec, write_gguf, fields, reason
) -> None:
    spec = make_spec(model={"uri": GGUF_URI})
    header = parse_gguf_header(write_gguf().read_bytes())
    p = plan_with(spec, dataclasses.replace(header, **fields))
    assert p.ok and p.memory is None
    assert p.memory_unknown_reason.startswith(f"the GGUF header of {GGUF_URI} ")
    assert reason in p.memory_unknown_reason and p.memory_unknown_reason.endswith("set model.hints")


def plan_with(spec, header):
    architecture = model_architecture(spec.model, header)
    return plan_deployment("x", spec, resolve_accelerator("h100-80gb", {}), architecture, NO_EXTRAS)
