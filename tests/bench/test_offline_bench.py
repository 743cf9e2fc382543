"""`kvfleet bench throughput|latency` end to end on the CPU with the tiny shape: the results file
has the agreed keys and rows; real shapes without a GPU exit 2 with a message."""

from __future__ import annotations

import json
import re

import pytest

from kvfleet_cli.main import main


@pytest.mark.slow
def test_throughput_writes_results_with_kvfleet_and_roofline_rows(tmp_path, capsys) -> None:
    argv = ["--shape", "tiny", "--num-prompts", "3", "--input-len", "4:9", "--output-len", "3"]
    assert main(["bench", "throughput", *argv, "--output-dir", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-cpu-throughput-tiny.json")
    result = json.loads(path.read_text())
    assert set(result) == {"gpu", "date", "command", "shape", "workload", "results"}
    assert result["command"].startswith("kvfleet bench throughput --shape tiny")
    assert result["workload"]["num_prompts"] == 3
    rows = {(r["system"], r["metric"]): r for r in result["results"]}
    assert rows[("kvfleet", "output_tokens_per_s")]["value"] > 0
    assert rows[("roofline", "output_tokens_per_s")]["unit"] == "tokens/s"
    assert "output_tokens_per_s" in capsys.readouterr().out  # the printed table


@pytest.mark.slow
def test_throughput_times_prompts_the_warm_up_did_not_cache(tmp_path) -> None:
    # Four 64-token prompts, at most 64 prompt tokens per step: four prompt steps, unless the
    # warm-up had left the same prompts in the prefix cache (then one step did it all).
    argv = ["--shape", "tiny", "--num-prompts", "4", "--input-len", "64", "--output-len", "1"]
    argv += ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--output-dir", str(tmp_path)]
    assert main(["bench", "throughput", *argv]) == 0
    [path] = tmp_path.glob("*-cpu-throughput-tiny.json")
    rows = {(r["system"], r["metric"]): r["value"] for r in json.loads(path.read_text())["results"]}
    assert rows[("kvfleet", "engine_steps")] >= 4


@pytest.mark.slow
def test_latency_reports_decode_rate_against_transformers(tmp_path) -> None:
    argv = ["--shape", "tiny", "--input-len", "5", "--output-len", "4", "--peer", "transformers"]
    assert main(["bench", "latency", *argv, "--output-dir", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-latency-tiny.json")
    systems = {r["system"] for r in json.loads(path.read_text())["results"]}
    assert systems == {"kvfleet", "transformers-generate", "roofline"}


def test_real_shape_without_gpu_exits_2(capsys) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["bench", "latency", "--shape", "llama-3.1-8b"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_bad_input_len_is_rejected_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--shape", "tiny", "--input-len", "9:4"])
    assert exit_info.value.code == 2
    assert "--input-len" in capsys.readouterr().err


def test_latency_with_a_calibrated_fp8_cache_records_the_file(tmp_path) -> None:
    import torch

    from kvfleet_engine.runner import kv_calibration

    # The tiny shape: 2 layers, 2 kv heads of 16. Any moments of that shape serve a speed run.
    moments = [torch.eye(16).expand(2, 16, 16) + 0.1 for _ in range(2)]
    calibration = tmp_path / "tiny.kv-calibration.safetensors"
    kv_calibration.save(calibration, moments, "tiny", 0)
    argv = ["--shape", "tiny", "--input-len", "5", "--output-len", "3", "--kv-cache-dtype", "fp8"]
    argv += ["--kv-cache-calibration", str(calibration), "--output-dir", str(tmp_path)]
    assert main(["bench", "latency", *argv]) == 0
    [path] = tmp_path.glob("*-latency-tiny.json")
    workload = json.loads(path.read_text())["workload"]
    assert workload["kv_cache_calibration"] == str(calibration)
    assert workload["kv_cache_dtype"] == "fp8"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-size", "3"], "argument --block-size: expected a power of two in [1, 256]"),
        (["--input-len", "100000"], "--input-len + --output-len must be <= 4096"),
        (["--output-dir", "/proc/x"], "argument --output-dir: cannot write to '/proc/x'"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens"),
    ],
)
@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_bad_engine_flag_exits_2_before_a_model_is_built(
    command: str, flags: list[str], message: str, monkeypatch, capsys
) -> None:
    from kvfleet_engine.bench import offline

    def no_model(args):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr(offline, "setup", no_model)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", command, "--shape", "tiny", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


TRACED = ["--shape", "tiny", "--num-prompts", "4", "--input-len", "64", "--output-len", "6"]
TRACED += ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--host-trace", "2"]


@pytest.mark.slow
def test_host_trace_skips_the_steps_asked_for(tmp_path, capsys) -> None:
    # Four 64-token prompts at 64 tokens a step, 6 output tokens: 4 prompt steps, then decodes.
    argv = [*TRACED, "--host-trace-skip", "4", "--output-dir", str(tmp_path)]
    assert main(["bench", "throughput", *argv]) == 0
    assert "host trace: 2 steps in" in capsys.readouterr().out


@pytest.mark.slow
def test_host_trace_says_when_the_workload_ends_within_the_skip(tmp_path, capsys) -> None:
    argv = [*TRACED, "--host-trace-skip", "50", "--output-dir", str(tmp_path)]
    assert main(["bench", "throughput", *argv]) == 0
    out = capsys.readouterr().out
    ended = r"host trace: the workload ended after \d+ steps, before any was profiled"
    assert re.search(ended, out)
