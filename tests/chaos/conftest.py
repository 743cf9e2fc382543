"""The chaos suite: real `kvfleet serve` processes under hostile input, load and faults. At the
end it prints the cases tried per category and the statuses seen (and writes them as JSON to
$KVFLEET_CHAOS_SUMMARY when set)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from chaosutil import TALLY


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvfleet_engine.tiny_model import write_tiny_model

    directory = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(directory)
    return directory


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    summary = TALLY.as_dict()
    if not summary["categories"] and not summary["faults"]:
        return
    write = terminalreporter.write_line
    terminalreporter.section("chaos suite: cases per category, statuses seen")
    for name, seen in summary["categories"].items():
        statuses = ", ".join(f"{status} x{count}" for status, count in seen["statuses"].items())
        write(f"{name:<28} {seen['cases']:>5}  {statuses}")
    for fault, text in summary["faults"].items():
        write(f"{fault:<28} {text}")
    path = os.environ.get("KVFLEET_CHAOS_SUMMARY")
    if path:
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
        write(f"written to {path}")
