"""The operator and the engine meet only at the `kvfleet serve` command line: every argument list
the operator renders must parse with the engine's own parser."""

from __future__ import annotations

import pytest

from kvfleet_operator.accelerators import resolve_accelerator
from kvfleet_operator.model_catalog import model_architecture
from kvfleet_operator.plan import ClusterFeatures, plan_deployment
from kvfleet_operator.render_pod import ENGINE_QUANTIZATION, engine_args

cli = pytest.importorskip("kvfleet_engine.server.cli")


def test_rendered_args_parse_with_the_engine_parser(make_spec) -> None:
    spec = make_spec(
        model={"servedModelName": "chat"},
        engine={
            "blockSize": 32,
            "gpuMemoryUtilization": 0.85,
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 4096,
            "enablePrefixCaching": False,
            "maxQueuedRequests": 100,
            "maxQueuedTokens": 50000,
        },
        sla={"ttftMs": 500, "tpotMs": 40},
        rollout={"drainTimeoutSeconds": 90},
    )
    profile = resolve_accelerator("h100-80gb", {})
    cluster = ClusterFeatures(leader_worker_set=False, service_monitor=False)
    plan = plan_deployment("x", spec, profile, model_architecture(spec.model), cluster)
    args = cli.build_parser().parse_args(engine_args(spec, plan, "/models/model"))
    assert (args.model, args.served_model_name, args.port) == ("/models/model", "chat", 8000)
    assert (args.block_size, args.max_num_seqs, args.max_num_batched_tokens) == (32, 64, 4096)
    assert args.gpu_memory_utilization == pytest.approx(0.85)
    assert args.max_model_len == 8192 and args.enable_prefix_caching is False
    assert (args.max_queued_requests, args.max_queued_tokens) == (100, 50000)
    assert (args.ttft_slo_ms, args.tpot_slo_ms, args.drain_timeout) == (500, 40, 90)


def test_a_gguf_file_is_passed_as_the_model_path(make_spec) -> None:
    from kvfleet_operator.render import render_deployment

    spec = make_spec(model={"uri": "hf://acme/Tiny-GGUF/q4/tiny-Q4_K_M.gguf"})
    profile = resolve_accelerator("h100-80gb", {})
    cluster = ClusterFeatures(leader_worker_set=False, service_monitor=False)
    plan = plan_deployment("x", spec, profile, model_architecture(spec.model), cluster)
    pod = render_deployment("x", "ns", spec, plan, profile)["spec"]["template"]["spec"]
    args = cli.build_parser().parse_args(pod["containers"][0]["args"])
    assert args.model == "/models/model/q4/tiny-Q4_K_M.gguf"


@pytest.mark.parametrize("weights", sorted(ENGINE_QUANTIZATION))
@pytest.mark.parametrize("kv_cache", ["fp8", "int8"])
def test_quantized_args_parse_with_the_engine_parser(
    make_spec, weights: str, kv_cache: str
) -> None:
    parser = cli.build_parser()
    if "--kv-cache-dtype" not in parser.format_help():
        pytest.skip("this engine's `kvfleet serve` has no --kv-cache-dtype yet")
    spec = make_spec(quantization={"weights": weights, "kvCache": kv_cache})
    profile = resolve_accelerator("h100-80gb", {})
    cluster = ClusterFeatures(leader_worker_set=False, service_monitor=False)
    plan = plan_deployment("x", spec, profile, model_architecture(spec.model), cluster)
    assert plan.ok, plan.problems
    args = parser.parse_args(engine_args(spec, plan, "/models/model"))
    assert (args.quantization, args.kv_cache_dtype) == (ENGINE_QUANTIZATION[weights], kv_cache)


@pytest.mark.parametrize("leader_worker_set", [False, True])
def test_group_args_parse_with_the_engine_parser(make_spec, leader_worker_set: bool) -> None:
    """A rank of a two-node group (tensor 8 over nodes of 4 GPUs): the flags of the shared
    contract (`--tensor-parallel-size`, `--nnodes`, `--node-rank`, `--master-addr`,
    `--master-port`), with the $(VAR)s the kubelet expands set to what rank 1 of group 0 would
    see."""
    from kvfleet_operator.render import render_children

    parser = cli.build_parser()
    if "--nnodes" not in parser.format_help():
        pytest.skip("this engine's `kvfleet serve` has no --nnodes yet (branch tp)")
    spec = make_spec(parallelism={"tensor": 8}, replicas=1)
    four = resolve_accelerator("h100-80gb", {}).model_copy(update={"devices_per_node": 4})
    profile = resolve_accelerator("h100-80gb", {"h100-80gb": four})
    cluster = ClusterFeatures(leader_worker_set=leader_worker_set, service_monitor=False)
    plan = plan_deployment("x", spec, profile, model_architecture(spec.model), cluster)
    assert plan.ok, plan.problems
    workload = render_children("x", "ns", spec, plan, profile, service_monitor=False)
    workload = [c for c in workload if c["kind"] in ("StatefulSet", "LeaderWorkerSet")]
    template = workload[0]["spec"]
    template = (
        template["leaderWorkerTemplate"]["workerTemplate"]
        if leader_worker_set
        else (template["template"])
    )
    env = {"KVFLEET_NODE_RANK": "1", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "x-group-0.x"}
    raw = template["spec"]["containers"][0]["args"]
    args = parser.parse_args([_expand(a, env) for a in raw])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (8, 1)
    assert (args.nnodes, args.node_rank, args.master_port) == (2, 1, 29500)
    leader = "x-group-0.x" if leader_worker_set else "x-group-0-0.x-group.ns.svc"
    assert args.master_addr == leader


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of a container argument."""
    for key, value in env.items():
        arg = arg.replace(f"$({key})", value)
    return arg


def test_the_group_key_variable_is_the_one_the_engine_reads() -> None:
    channel = pytest.importorskip("kvfleet_engine.parallel.channel")
    from kvfleet_operator.render_pod import PARALLEL_AUTHKEY_ENV

    assert PARALLEL_AUTHKEY_ENV == channel.AUTHKEY_ENV
