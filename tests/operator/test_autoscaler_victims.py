"""The scale-down victims' pod-deletion-cost, written by the Builtin autoscaler's tick, when a
pod goes between the tick's list of pods and its write."""

from __future__ import annotations

from test_status_writers import NAME, NS, T0, TickCluster, engine_metrics, engine_pod, engines

from kvfleet_operator.autoscaling.autoscaler import autoscale_once
from kvfleet_operator.autoscaling.pods import DELETION_COST

BODIES = {"127.1.0.2": engine_metrics(100.0, running=2), "127.1.0.3": engine_metrics(100.0)}


async def test_a_victim_deleted_before_its_mark_does_not_stop_the_scale_down() -> None:
    """No tokens generated: 2 -> 1, and the idle pod is the victim. It was deleted (evicted, its
    node lost) after the tick listed it: server-side apply of its annotation tried to create a
    pod (422), the tick failed and wrote neither the replicas nor its status. Now the write
    names the pod's uid (409 for a pod that is gone) and the tick goes on."""
    cluster = TickCluster(2, [engine_pod("busy", "127.1.0.2"), engine_pod("idle", "127.1.0.3")])
    async with engines(cluster, BODIES, lambda: None) as http:
        await autoscale_once(cluster, http, NS, NAME, T0)  # type: ignore[arg-type]
    async with engines(cluster, BODIES, lambda: cluster.pods.pop("idle")) as http:
        decision, _ = await autoscale_once(cluster, http, NS, NAME, T0 + 5)  # type: ignore[arg-type]
    assert decision is not None and decision.victims == ("idle",)
    assert cluster.deployment["spec"]["replicas"] == 1
    assert cluster.events == ["ScaledDown"]
    assert cluster.infd["status"]["autoscaling"]["desiredReplicas"] == 1


async def test_the_victim_that_is_there_is_marked() -> None:
    cluster = TickCluster(2, [engine_pod("busy", "127.1.0.2"), engine_pod("idle", "127.1.0.3")])
    for now in (T0, T0 + 5):
        async with engines(cluster, BODIES, lambda: None) as http:
            await autoscale_once(cluster, http, NS, NAME, now)  # type: ignore[arg-type]
    assert cluster.pods["idle"]["metadata"]["annotations"] == {DELETION_COST: "-1000"}
    assert "annotations" not in cluster.pods["busy"]["metadata"]
    assert cluster.deployment["spec"]["replicas"] == 1
