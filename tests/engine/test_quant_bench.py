"""`kvfleet bench latency|throughput --quantization ...`: each method runs on the same random
weights in one process, with its own roofline counting the packed weight bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvfleet_cli.main import main
from kvfleet_engine.bench import roofline, shapes


@pytest.mark.slow
def test_latency_runs_each_quantization_against_its_roofline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--shape", "tiny", "--input-len", "5", "--output-len", "4"]
    argv += ["--quantization", "none,awq,int8", "--output-dir", str(tmp_path)]
    assert main(["bench", "latency", *argv]) == 0
    [path] = tmp_path.glob("*-cpu-latency-tiny-awq-int8.json")
    result = json.loads(path.read_text())
    assert result["workload"]["quantization"] == ["none", "awq", "int8"]
    rows = {(r["system"], r["metric"]): r["value"] for r in result["results"]}
    for system in ("kvfleet", "kvfleet-awq", "kvfleet-int8"):
        assert rows[(system, "decode_tokens_per_s")] > 0
    weight_bytes = {s: rows[(s, "weight_bytes_per_step")] for s in ("roofline", "roofline-awq")}
    assert weight_bytes["roofline-awq"] < weight_bytes["roofline"]
    table = capsys.readouterr().out
    assert "kvfleet-awq" in table and "roofline-int8" in table


def test_roofline_counts_packed_bytes_of_the_8b_shape() -> None:
    model = shapes.build_random_model("llama-3.1-8b", torch.bfloat16, "meta")
    hidden, inner, layers, vocab = 4096, 14336, 32, 128256
    matrices = [(4096, hidden), (1024, hidden), (1024, hidden), (hidden, 4096)]
    matrices += [(inner, hidden), (inner, hidden), (hidden, inner)]
    layer_weights = sum(n * k for n, k in matrices)
    per_channel = sum(n for n, _ in matrices)
    rest = 2 * (vocab * hidden + (2 * layers + 1) * hidden)  # lm_head and norms in bf16
    int4 = layers * (layer_weights // 2 + 4 * layer_weights // 128) + rest
    int8 = layers * (layer_weights + 4 * per_channel) + rest
    assert shapes.weight_bytes_per_step(model, "awq", 128) == int4
    assert shapes.weight_bytes_per_step(model, "gptq", 128) == int4
    assert shapes.weight_bytes_per_step(model, "fp8") == int8
    assert shapes.weight_bytes_per_step(model) == 2 * layers * layer_weights + rest
    assert int4 / 1e9 == pytest.approx(4.76, abs=0.01)


def test_unknown_quantization_is_rejected_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", "--shape", "tiny", "--quantization", "none,int3"])
    assert exit_info.value.code == 2
    assert "--quantization takes a comma-separated list of none, fp8" in capsys.readouterr().err


def test_the_sweep_times_only_the_kinds_asked_for_beside_bf16(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfleet_engine.bench import quant_candidates, quant_sweep

    jobs = quant_sweep.jobs([1], ("bf16", "fp8"))
    assert {kind for kind, _, _ in jobs} == {"bf16", "fp8"}
    assert len(jobs) == 1 + len(quant_candidates.fp8_configs(1))
    with pytest.raises(SystemExit) as exited:
        quant_sweep.main(["--kinds", "fp8,int3"])
    assert exited.value.code == 2
    assert "--kinds: ['int3'] unknown" in capsys.readouterr().err


def test_fp8_prompts_are_held_to_the_fp8_matrix_rate_where_the_gpu_has_one() -> None:
    costs = {
        name: roofline.ModelCosts(
            weight_bytes=8_000_000_000,
            kv_bytes_per_token=65_536,
            weights_per_token=7_000_000_000,
            fp8_products=name == "fp8",
        )
        for name in ("none", "int8", "fp8")
    }
    lens = [3968] * 64
    hopper = roofline.Ceilings(bandwidth=4.0e12, matmul_flops=700e12, fp8_matmul_flops=1300e12)
    prefill = {n: roofline.offline_seconds(c, hopper, lens, 1, 64) for n, c in costs.items()}
    # 64 x 3,968 prompt tokens, 14 GFLOP each, at 1,300 (fp8) or 700 TFLOP/s (everything else)
    assert prefill["fp8"] == pytest.approx(64 * 3968 * 14e9 / 1300e12)
    assert prefill["int8"] == prefill["none"] == pytest.approx(64 * 3968 * 14e9 / 700e12)
    # A GPU without fp8 products (no fp8 rate measured): every kind at the bf16 rate.
    ampere = roofline.Ceilings(bandwidth=2.0e12, matmul_flops=300e12)
    assert roofline.offline_seconds(costs["fp8"], ampere, lens, 1, 64) == pytest.approx(
        64 * 3968 * 14e9 / 300e12
    )
    # A large decode batch is compute-bound too: fp8's step is the shorter.
    big = {n: roofline.decode_step_seconds(c, hopper, 4096, 0) for n, c in costs.items()}
    assert big["fp8"] < big["int8"] == big["none"]
