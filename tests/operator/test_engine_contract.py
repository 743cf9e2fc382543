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
def test_quantized_args_parse_with_the_engine_parser(make_spec, weights: str) -> None:
    parser = cli.build_parser()
    if "--kv-cache-dtype" not in parser.format_help():
        pytest.skip("this engine's `kvfleet serve` has no --kv-cache-dtype yet")
    spec = make_spec(quantization={"weights": weights, "kvCache": "fp8"})
    profile = resolve_accelerator("h100-80gb", {})
    cluster = ClusterFeatures(leader_worker_set=False, service_monitor=False)
    plan = plan_deployment("x", spec, profile, model_architecture(spec.model), cluster)
    assert plan.ok, plan.problems
    args = parser.parse_args(engine_args(spec, plan, "/models/model"))
    assert (args.quantization, args.kv_cache_dtype) == (ENGINE_QUANTIZATION[weights], "fp8")
