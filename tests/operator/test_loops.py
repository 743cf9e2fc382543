"""The resync loop: reconciles watched objects and keeps one autoscaler per autoscaled object."""

from __future__ import annotations

import asyncio
from typing import Any

from kvfleet_operator.loops import Flag, Loops


class FakeCluster:
    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects

    async def list(self, api_version: str, kind: str) -> list[dict[str, Any]]:
        return self.objects


def obj(namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name}, "spec": spec}


async def test_resync_reconciles_watched_namespaces_and_manages_autoscalers() -> None:
    reconciled: list[tuple[str, str]] = []
    running: set[tuple[str, str]] = set()

    async def reconcile(cluster: Any, namespace: str, name: str) -> None:
        reconciled.append((namespace, name))

    async def autoscale(cluster: Any, namespace: str, name: str, stopped: Flag) -> None:
        running.add((namespace, name))
        while not stopped:
            await stopped.wait(0.01)
        running.discard((namespace, name))

    cluster = FakeCluster(
        [
            obj("team-a", "fixed", replicas=1),
            obj("team-a", "auto", autoscaling={"maxReplicas": 2}),
            obj("team-a", "paused", autoscaling={"maxReplicas": 2}, suspend=True),
            obj("other", "auto", autoscaling={"maxReplicas": 2}),
        ]
    )
    loops = Loops(cluster, ["team-*"], reconcile, autoscale)  # type: ignore[arg-type]
    await loops.run_once()
    await asyncio.sleep(0.02)
    assert reconciled == [("team-a", "fixed"), ("team-a", "auto"), ("team-a", "paused")]
    assert running == {("team-a", "auto")}

    await loops.run_once()  # steady state: the same task keeps running
    assert running == {("team-a", "auto")}

    cluster.objects = [obj("team-a", "auto", replicas=2)]  # autoscaling switched off
    await loops.run_once()
    assert running == set()


async def test_run_stops_cleanly() -> None:
    async def reconcile(cluster: Any, namespace: str, name: str) -> None:
        return None

    async def autoscale(cluster: Any, namespace: str, name: str, stopped: Flag) -> None:
        await stopped.wait()

    cluster = FakeCluster([obj("ns", "auto", autoscaling={"maxReplicas": 2})])
    loops = Loops(cluster, [], reconcile, autoscale)  # type: ignore[arg-type]
    task = asyncio.create_task(loops.run())
    await asyncio.sleep(0.05)
    await loops.stop()
    await asyncio.wait_for(task, 5)


async def test_a_wake_only_manages_autoscalers() -> None:
    reconciled: list[str] = []

    async def reconcile(cluster: Any, namespace: str, name: str) -> None:
        reconciled.append(name)

    async def autoscale(cluster: Any, namespace: str, name: str, stopped: Flag) -> None:
        await stopped.wait()

    loops = Loops(FakeCluster([obj("ns", "a", replicas=1)]), [], reconcile, autoscale)  # type: ignore[arg-type]
    await loops.run_once(reconcile=False)
    assert reconciled == []
