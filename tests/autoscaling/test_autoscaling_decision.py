"""The decision function on synthetic traces: what replica counts a user would see over time."""

from __future__ import annotations

import itertools
import random

from autoscaling_fleet import Fleet

from kvfleet_operator.autoscaling.decision import decide
from kvfleet_operator.autoscaling.samples import EngineSample, Observation, PodObservation
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.autoscaling.state import ScalerState


def spec(targets: dict[str, object] | None = None, **behavior: object) -> AutoscalingSpec:
    return AutoscalingSpec.model_validate(
        {
            "minReplicas": 1,
            "maxReplicas": 10,
            "targets": targets or {"generationTokenRate": {"tokensPerSecond": 100}},
            "behavior": {"warmupSeconds": 0, **behavior},
        }
    )


def step(before: float, after: float, at: float):
    return lambda t: before if t < at else after


def test_step_in_load_reaches_target_within_panic_window() -> None:
    fleet = Fleet(spec(), demand=step(50, 400, at=300), replicas=1)
    fleet.run(until=400)
    assert fleet.replicas_at(299) == 1
    panic_window = fleet.spec.behavior.panic_window_seconds
    assert fleet.replicas_at(300 + panic_window) == 4  # 400 tok/s / 100 per replica
    modes = {d.mode for t, _, d in fleet.timeline if 300 < t <= 300 + panic_window}
    assert modes == {"Panic"}
    assert fleet.replicas_at(400) == 4  # and it stays there: no overshoot
    assert fleet.scale_events() == 2  # 1 -> 3 in the first panic tick, then 3 -> 4


def test_no_new_scale_up_while_replicas_are_pending() -> None:
    # Two small steps (no panic): the first adds a replica; the second comes while that replica
    # is still starting, so it waits for it to be ready before asking for more.
    def demand(t: float) -> float:
        return 280 if t < 300 else 380 if t < 330 else 480

    fleet = Fleet(spec(), demand=demand, replicas=3, startup=60)
    fleet.run(until=600)
    assert all(d.mode == "Stable" for _, _, d in fleet.timeline)
    first_up = min(t for t, r, _ in fleet.timeline if r == 4)
    held = [t for t, _, d in fleet.timeline if "pending" in d.reason]
    assert held and min(held) > first_up
    second_up = min(t for t, r, _ in fleet.timeline if r == 5)
    assert second_up >= first_up + 60  # not before the first new replica is ready
    assert fleet.replicas_at(600) == 5


def test_noisy_steady_load_does_not_flap() -> None:
    noise = random.Random(7)
    fleet = Fleet(spec(), demand=lambda t: 250 * (1 + noise.uniform(-0.15, 0.15)), replicas=3)
    fleet.run(until=3600)
    assert fleet.scale_events() == 0
    assert fleet.replicas_at(3600) == 3


def test_noisy_load_near_a_boundary_does_not_flap_either() -> None:
    # Demand right at 3 replicas' worth: the tolerance and scale-down stabilization keep it
    # from oscillating between 3 and 4.
    noise = random.Random(11)
    fleet = Fleet(spec(), demand=lambda t: 300 * (1 + noise.uniform(-0.25, 0.25)), replicas=3)
    fleet.run(until=3600)
    assert fleet.scale_events(after=600) <= 2


def test_vanished_spike_does_not_scale_down_before_stabilization_window() -> None:
    down_window = 120
    spiky = spec(scaleDown={"stabilizationWindowSeconds": down_window})
    fleet = Fleet(spiky, demand=lambda t: 800 if 300 <= t < 320 else 150, replicas=2)
    fleet.run(until=1500)
    peak = max(r for _, r, _ in fleet.timeline)
    assert peak >= 6
    peak_time = min(t for t, r, _ in fleet.timeline if r == peak)
    first_down = min(t for t, r, _ in fleet.timeline if t > peak_time and r < peak)
    assert first_down >= 320 + down_window - fleet.spec.behavior.stable_window_seconds
    assert first_down >= peak_time + down_window
    # Back to what 150 tok/s needs: one replica per period, each after a drain wait.
    assert fleet.replicas_at(1500) == 2


def test_scale_down_rate_limit_removes_one_replica_per_period() -> None:
    fleet = Fleet(
        spec(scaleDown={"stabilizationWindowSeconds": 0, "periodSeconds": 60}),
        demand=lambda t: 100,
        replicas=6,
    )
    fleet.run(until=600)
    downs = [t for (t, r, _), (_, r2, _) in itertools.pairwise(fleet.timeline) if r2 < r]
    assert fleet.replicas_at(600) == 1
    gaps = [b - a for a, b in itertools.pairwise(downs)]
    assert all(gap >= 60 for gap in gaps)


def test_missing_metrics_hold() -> None:
    fleet = Fleet(
        spec(scaleDown={"stabilizationWindowSeconds": 0}),
        demand=lambda t: 800 if t < 200 else 0,
        replicas=8,
        scrape_fails=lambda t: t >= 200,
    )
    fleet.run(until=800)
    assert fleet.replicas_at(800) == 8
    last = fleet.timeline[-1][2]
    assert last.limited == "MetricsUnavailable"
    assert last.reason.startswith("hold")


def test_unschedulable_replicas_stop_further_asking() -> None:
    fleet = Fleet(spec(), demand=step(100, 800, at=100), replicas=1, unschedulable_above=3)
    fleet.run(until=400)
    final = fleet.timeline[-1][2]
    assert final.limited == "InsufficientCapacity"
    # It asked once (panic), the extra pods stayed Pending, and it asked for no more.
    asked = max(r for _, r, _ in fleet.timeline)
    assert fleet.replicas_at(400) == asked
    assert fleet.scale_events() == 1


def test_max_replicas_caps_and_reports() -> None:
    fleet = Fleet(spec(), demand=lambda t: 5000, replicas=2)
    fleet.run(until=300)
    assert fleet.replicas_at(300) == 10
    assert fleet.timeline[-1][2].limited == "DesiredAboveMax"


def test_kv_utilization_signal() -> None:
    fleet = Fleet(spec({"kvCacheUtilization": 0.5}), demand=lambda t: 300, capacity=400)
    fleet.run(until=300)
    # One pod at 300 of 400 tok/s: KV usage 0.75 against 0.5 -> 2 replicas at 0.375 each.
    assert fleet.replicas_at(300) == 2
    signal = fleet.timeline[-1][2].signals[0]
    assert signal.name == "kvCacheUtilization"
    assert signal.value is not None and abs(signal.value - 0.375) < 0.01


def test_desired_is_the_max_over_signals() -> None:
    both = spec({"kvCacheUtilization": 0.5, "waitingRequestsPerReplica": 2})
    pods = tuple(
        PodObservation(f"p{i}", -100.0, _sample(0.0, 0.0, kv=0.6, waiting=5.0)) for i in range(2)
    )
    decision = decide(both, Observation(0.0, 2, 2, 0, pods), ScalerState())
    desired = {s.name: s.desired for s in decision.signals}
    assert desired == {"kvCacheUtilization": 3, "waitingRequestsPerReplica": 5}
    assert decision.desired_replicas == 5
    assert "waitingRequestsPerReplica 5/2" in decision.reason


def test_capacity_fraction_target() -> None:
    fleet = Fleet(
        spec({"generationTokenRate": {"capacityFraction": 0.5}}),
        demand=lambda t: 800,
        capacity=400,
        replicas=1,
    )
    fleet.run(until=300)
    assert fleet.replicas_at(300) == 4  # 800 / (0.5 x 400)


def test_warming_pods_are_left_out() -> None:
    pod = PodObservation("young", ready_since=95.0, sample=_sample(100.0, 1000.0))
    observation = Observation(100.0, 1, 1, 0, (pod,))
    decision = decide(spec(warmupSeconds=60), observation, ScalerState())
    assert decision.desired_replicas == 1
    assert decision.limited == "MetricsUnavailable"
    assert "warm-up" in decision.reason


def test_latency_target_scales_by_ratio() -> None:
    latency_spec = spec({"ttft": {"quantile": 0.9, "seconds": 0.5}})
    buckets_then = ((0.25, 0.0), (0.5, 0.0), (1.0, 0.0), (2.0, 0.0), (float("inf"), 0.0))
    buckets_now = ((0.25, 0.0), (0.5, 0.0), (1.0, 100.0), (2.0, 100.0), (float("inf"), 100.0))
    state = ScalerState()
    for now, buckets in ((0.0, buckets_then), (5.0, buckets_now)):
        pods = tuple(
            PodObservation(f"p{i}", -100.0, _sample(now, 0.0, ttft=buckets)) for i in range(2)
        )
        decision = decide(latency_spec, Observation(now, 2, 2, 0, pods), state)
        state = decision.state
    signal = decision.signals[0]
    assert signal.name == "ttft"
    assert signal.value is not None and 0.9 < signal.value <= 1.0  # p90 inside (0.5, 1.0]
    assert decision.desired_replicas == 4  # ceil(2 x 0.95 / 0.5)


def test_scale_down_waits_for_least_busy_pod_to_drain() -> None:
    drain_spec = spec(
        scaleDown={"stabilizationWindowSeconds": 0, "drainTimeoutSeconds": 30},
        targets=None,
    )
    state = ScalerState()
    busy = {"a": 3.0, "b": 1.0, "c": 5.0}

    def observe(now: float) -> Observation:
        pods = tuple(
            PodObservation(name, -100.0, _sample(now, 0.0, running=busy[name])) for name in busy
        )
        return Observation(now, 3, 3, 0, pods)

    decisions = []
    for now in (0.0, 5.0, 10.0):
        decision = decide(drain_spec, observe(now), state)
        state = decision.state
        decisions.append(decision)
    assert decisions[-1].desired_replicas == 3  # still draining
    assert decisions[-1].victims[0] == "b"  # least work in flight
    assert "draining" in decisions[-1].reason
    busy["b"] = 0.0
    decision = decide(drain_spec, observe(15.0), state)
    assert decision.desired_replicas == 2  # only one removed per period
    assert decision.victims == ("b",)


def test_scale_down_removes_a_pod_whose_engine_is_not_serving_first() -> None:
    down = spec(
        {"kvCacheUtilization": 0.5},
        scaleDown={"stabilizationWindowSeconds": 0, "drainTimeoutSeconds": 30},
    )
    pods = (
        PodObservation("serving", -100.0, _sample(0.0, 0.0, running=0.0)),
        PodObservation("loading", -100.0, None),  # ready per kubelet, engine not answering
    )
    decision = decide(down, Observation(0.0, 2, 2, 0, pods), ScalerState())
    assert decision.desired_replicas == 1
    assert decision.victims == ("loading",)


def _sample(
    now: float,
    generated: float,
    running: float = 0.0,
    ttft: tuple = (),
    kv: float = 0.1,
    waiting: float = 0.0,
) -> EngineSample:
    return EngineSample(
        time=now,
        generation_tokens_total=generated,
        prompt_tokens_total=generated,
        kv_cache_usage=kv,
        requests_waiting=waiting,
        requests_running=running,
        capacity_generation=400.0,
        capacity_prompt=800.0,
        ttft_buckets=ttft,
    )
