"""Keeps each test module on one pytest-xdist worker (`make test` runs two, `--dist loadgroup`):
module-scoped fixtures, such as a served engine, then start once per module, not once per worker.
The e2e tests are grouped by e2e/conftest.py (all on the worker that owns the local cluster)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not item.nodeid.startswith("e2e/") and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
