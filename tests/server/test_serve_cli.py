"""`kvfleet serve` refuses bad flags with a message naming them and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-queued-requests", "0"], "--max-queued-requests: expected a positive integer"),
        (["--port", "99999"], "--port: expected a port number in 1..65535, got 99999"),
        (["--port", "-5"], "--port: expected a port number in 1..65535, got -5"),
        (["--port", "0"], "--port: expected a port number in 1..65535, got 0"),
        (["--drain-timeout", "nan"], "--drain-timeout: expected a finite number >= 0, got 'nan'"),
        (["--drain-timeout", "-1"], "--drain-timeout: expected a finite number >= 0, got '-1'"),
        (["--header-timeout", "0"], "--header-timeout: expected a positive number, got 0.0"),
        (["--header-timeout", "-2"], "--header-timeout: expected a positive number, got -2.0"),
        (["--header-timeout", "soon"], "--header-timeout: expected a positive number, got 'soon'"),
        # a prefix of a flag is no flag: `--quant` in engine.extraArgs had set --quantization
        (["--quant", "fp8"], "unrecognized arguments: --quant fp8"),
        (["--api", "sk-secret"], "unrecognized arguments: --api sk-secret"),
        (
            ["--tensor-parallel-size", "3"],
            "--tensor-parallel-size=3 does not divide the model's num_attention_heads",
        ),
        # settings checked together are named as flags too, not as EngineConfig's keywords
        (
            ["--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
            "error: --max-num-batched-tokens must be >= --max-num-seqs (64), got 32",
        ),
        (["--block-size", "3"], "error: --block-size must be "),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    tiny_model_dir: Path, flags: list[str], message: str
) -> None:
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(tiny_model_dir), *flags]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_shows_model_as_optional_with_its_default() -> None:
    """Without --model the embedded SmolLM2 is served (tests/server/test_smollm2_serve.py), so
    the usage line must not mark --model as required."""
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--help"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    usage = proc.stdout.split("\n\n")[0]
    assert "[--model MODEL]" in usage
    assert "embedded SmolLM2-135M-Instruct" in " ".join(proc.stdout.split())


def test_a_model_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    """The flags parsed but the model directory is unusable: one error line, not the usage
    block of every flag before it."""
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"kvfleet serve: error: model: {str(tmp_path)!r} is neither a model directory "
        "(no config.json) nor a GGUF file"
    ]


def test_a_port_in_use_is_one_line_before_the_model_loads(tiny_model_dir: Path) -> None:
    """The socket is bound first: the refusal comes at once, not from uvicorn after the load."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(tiny_model_dir),
                   "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"kvfleet serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "Traceback" not in proc.stderr and "engine core" not in proc.stderr
