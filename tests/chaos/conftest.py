"""The chaos suite: real `kvfleet serve` processes under hostile input, load and faults. At the
end it prints the cases tried per category and the statuses seen (and writes them as JSON to
$KVFLEET_CHAOS_SUMMARY when set); under pytest-xdist each worker hands its tally to the
controller (tests/conftest.py), which prints the sum."""

from __future__ import annotations

from pathlib import Path

import pytest
from chaosutil import TALLY, WORKER_OUTPUT_KEY, report


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvfleet_engine.tiny_model import write_tiny_model

    directory = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(directory)
    return directory


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: hand the tally to the controller, which prints it."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output[WORKER_OUTPUT_KEY] = TALLY.as_dict()  # plain dicts: execnet carries them


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not hasattr(terminalreporter.config, "workeroutput"):  # a run without xdist
        report(terminalreporter, TALLY)
