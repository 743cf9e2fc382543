"""Keeps each test module on one pytest-xdist worker (`make test` runs two, `--dist loadgroup`):
module-scoped fixtures, such as a served engine, then start once per module, not once per worker.
The e2e tests are grouped by e2e/conftest.py (all on the worker that owns the local cluster)."""

from __future__ import annotations

import pytest


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
