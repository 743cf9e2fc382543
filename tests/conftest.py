"""Keeps each test module on one pytest-xdist worker (`make test` runs two, `--dist loadgroup`):
module-scoped fixtures, such as a served engine, then start once per module, not once per worker.
The e2e tests are grouped by e2e/conftest.py (all on the worker that owns the local cluster).
It also prints, on the xdist controller, the chaos suite's tally that the workers hand back."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

_CHAOS = Path(__file__).parent / "chaos"
_worker_tallies: list[dict[str, Any]] = []


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not item.nodeid.startswith("e2e/") and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.hookimpl(trylast=True)  # after pytest-xdist's hook, which appends "@<group>" to node ids
def pytest_collection_finish(session: pytest.Session) -> None:
    """Fail loudly if `--dist loadgroup` lost the groups: pytest-xdist 3.8 writes the group into
    `item._nodeid`, which pytest 9.2 no longer reads (pyproject pins pytest below 9.2). Without
    the groups every test is scheduled alone: two workers would each start the module's servers,
    and the e2e tests would run on both workers against the one local cluster at once."""
    if not session.config.getoption("loadgroup", default=False):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            raise pytest.UsageError(
                f"pytest {pytest.__version__} with pytest-xdist: --dist loadgroup did not group "
                f"{item.nodeid}; use a pytest that pyproject.toml allows"
            )


def _chaosutil() -> Any:
    """tests/chaos/chaosutil (its tally and report), imported at the end of a run."""
    sys.path.insert(0, str(_CHAOS))
    import chaosutil

    return chaosutil


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, called on the controller
def pytest_testnodedown(node: Any, error: object) -> None:
    """A worker finished: keep the chaos tally it handed back (tests/chaos/conftest.py)."""
    summary = getattr(node, "workeroutput", {}).get(_chaosutil().WORKER_OUTPUT_KEY)
    if summary is not None:
        _worker_tallies.append(summary)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _worker_tallies:
        return
    chaosutil = _chaosutil()
    tally = chaosutil.Tally()
    for summary in _worker_tallies:
        tally.merge(summary)
    chaosutil.report(terminalreporter, tally)
