"""Bad input to `kvfleet bench ...` ends in one line naming the flag and exit code 2, before any
model loads or load is sent: never a traceback, and never at the end of a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet_cli.main import main

_REFUSED = "http://127.0.0.1:1"  # nothing listens on port 1
_SERVE = ["bench", "serve", "--url", _REFUSED, "--concurrency", "1", "--num-prompts", "1"]


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last line on stderr of a command that must exit 2."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("bench", ["latency", "throughput"])
@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--seed", "-1", "argument --seed: expected an integer in [0, 2**64 - 1], got -1"),
        (
            "--seed",
            str(2**64),
            f"argument --seed: expected an integer in [0, 2**64 - 1], got {2**64}",
        ),
        ("--host-trace", "-1", "argument --host-trace: expected an integer >= 0, got -1"),
        ("--gpu-memory-utilization", "nan", "--gpu-memory-utilization must be in (0, 1], got nan"),
    ],
)
def test_offline_bench_flag(
    bench: str, flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error(["bench", bench, "--shape", "tiny", flag, value], capsys)
    assert line == f"kvfleet bench {bench}: error: {message}"


def test_host_trace_skip_needs_host_trace(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(["bench", "throughput", "--shape", "tiny", "--host-trace-skip", "5"], capsys)
    assert line == "kvfleet bench throughput: error: --host-trace-skip needs --host-trace N"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--temperature", "nan"],
            "argument --temperature: expected a finite number >= 0, got 'nan'",
        ),
        (
            ["--temperature", "-1"],
            "argument --temperature: expected a finite number >= 0, got '-1'",
        ),
        (["--seed", "-1"], "argument --seed: expected an integer in [0, 2**64 - 1], got -1"),
        (
            ["--dataset", "jsonl", "--dataset-path", "/nonexistent"],
            "argument --dataset-path: no such file: '/nonexistent'",
        ),
        (
            ["--dataset", "jsonl", "--dataset-path", "/"],
            "argument --dataset-path: is a directory: '/'",
        ),
        (["--output", "/"], "argument --output: cannot write to '/': it is a directory"),
        ([], f"--url {_REFUSED}: [Errno 111] Connection refused"),
    ],
)
def test_bench_serve_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _error([*_SERVE, *argv], capsys) == f"kvfleet bench serve: error: {message}"


@pytest.mark.parametrize("url", ["localhost:8000", "", "http://"])
def test_bench_serve_url(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(["bench", "serve", "--url", url, "--concurrency", "1"], capsys)
    assert line == (
        "kvfleet bench serve: error: argument --url: expected http://HOST[:PORT] or https://..., "
        f"got {url!r}"
    )


def test_bench_serve_output_file_under_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _error([*_SERVE, "--output", str(blocker / "result.json")], capsys)
    assert line == (
        f"kvfleet bench serve: error: argument --output: cannot write to {str(blocker)!r}: "
        f"{blocker} is not a directory"
    )


def test_bench_chat_missing_model(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(["bench", "chat", "--model", "/nonexistent", "--no-peer"], capsys)
    assert line == (
        "kvfleet bench chat: error: model: '/nonexistent' is neither a model directory "
        "(no config.json) nor a GGUF file"
    )


def test_bench_chat_device_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(["bench", "chat", "--device", "tpu"], capsys)
    assert line == (
        "kvfleet bench chat: error: argument --device: expected auto, cpu, cuda or cuda:N, "
        "got 'tpu'"
    )
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _error(["bench", "chat", "--output", str(blocker)], capsys)
    assert line == (
        f"kvfleet bench chat: error: argument --output: cannot write to {str(blocker)!r}: "
        f"{blocker} is not a directory"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("bench", ["chat", "accuracy"])
def test_bench_cuda_without_cuda(
    bench: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", bench, "--device", "cuda", "--output", str(tmp_path)]
    if bench == "accuracy":
        argv += ["--config", "a=/nonexistent"]
    line = _error(argv, capsys)
    assert line == (
        f"kvfleet bench {bench}: error: --device: device 'cuda' requested but CUDA is not available"
    )


def test_bench_accuracy_nan_bound(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(["bench", "accuracy", "--config", "a=/nonexistent", "--bound", "a=nan"], capsys)
    assert line == "kvfleet bench accuracy: error: --bound must be NAME=PERCENT, got 'a=nan'"


@pytest.mark.parametrize("flag", ["--splits", "--prefix-splits"])
def test_the_shared_prefix_bench_refuses_splits_below_one(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m kvfleet_engine.bench.shared_prefix`: before any tensor reaches a GPU."""
    from kvfleet_engine.bench import shared_prefix

    with pytest.raises(SystemExit) as exit_info:
        shared_prefix.main([flag, "2", "0"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"error: {flag} takes splits of 1 or more, got [2, 0]")
