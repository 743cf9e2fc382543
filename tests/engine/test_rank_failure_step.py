"""The driver's step against failed ranks (`WorkerGroup.step`): what a caller sees when a rank
has already failed, when a collective fails, and when a step hangs on a dead rank."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kvfleet_engine.parallel import workers as workers_module
from kvfleet_engine.parallel.workers import RankFailed, WorkerGroup


def group() -> WorkerGroup:
    config: Any = SimpleNamespace(parallel=SimpleNamespace(world_size=2))
    return WorkerGroup(config)


def test_a_step_after_a_failure_raises_the_monitors_reason() -> None:
    ranks = group()
    ranks.failure = "rank 1 (pid 7) exited with code 9"
    ran = []
    with pytest.raises(RankFailed, match="rank 1 \\(pid 7\\) exited with code 9"):
        with ranks.step("a collective"):
            ran.append(True)
    assert not ran  # nothing of the step runs


def test_a_failed_collective_becomes_rank_failed_naming_it() -> None:
    ranks = group()  # no monitor: the collective's own error is the reason
    with pytest.raises(RankFailed, match="a receive failed: Connection closed by peer"):
        with ranks.step("a receive"):
            raise RuntimeError("Connection closed by peer")
    with pytest.raises(ValueError):  # anything else passes through
        with ranks.step("a receive"):
            raise ValueError("not a rank's")


def test_a_step_stuck_on_a_dead_rank_ends_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    exited = threading.Event()
    monkeypatch.setattr(workers_module, "FAILURE_EXIT_GRACE_S", 0.05)
    monkeypatch.setattr(workers_module.os, "_exit", lambda code: (exits.append(code), exited.set()))
    ranks = group()
    with ranks.step("a collective"):  # the monitor finds the rank gone while the step waits
        ranks._arm_exit("rank 1 disconnected")
        assert exited.wait(5)
    assert exits == [1]
    # A driver that raised in time (or was idle) is not ended.
    exits.clear()
    ranks._arm_exit("rank 1 disconnected")
    ranks.failure = "rank 1 disconnected"
    with pytest.raises(RankFailed):
        with ranks.step("a collective"):
            pass
    threading.Event().wait(0.2)
    assert exits == []
