"""Careless flags to `kvfleet` commands end in one line naming the flag (or the environment
variable) and exit code 2, before a model loads or load is sent: never a traceback, and never a
value accepted and then ignored."""

from __future__ import annotations

import pytest

from kvfleet_cli.main import main

_NO_MODEL = "/nonexistent-model"  # a flag refused before the model is read never names it
_REFUSED = "http://127.0.0.1:1"  # nothing listens on port 1
_SERVE = ["bench", "serve", "--url", _REFUSED, "--concurrency", "1", "--num-prompts", "1"]
_KEY_RULE = (
    "expected a non-empty key of printable ASCII characters, not starting or ending with a "
    "space (unset: no authentication)"
)


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
