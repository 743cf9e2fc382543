"""Replay a recorded trace: /metrics of a real engine (tiny model, CPU) polled about once a
second while `kvfleet bench serve` ran 160 requests at concurrency 8 (recorded with
record_trace.py; the file keeps the command and the load's start and end)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from kvfleet_operator.autoscaling.decision import Decision, decide
from kvfleet_operator.autoscaling.promtext import engine_sample, parse
from kvfleet_operator.autoscaling.samples import Observation, PodObservation
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.autoscaling.state import ScalerState

TRACE = json.loads((Path(__file__).parent / "traces" / "tiny-cpu-step.json").read_text())
SPEC = AutoscalingSpec.model_validate(
    {
        "minReplicas": 1,
        "maxReplicas": 6,
        "targets": {"generationTokenRate": {"tokensPerSecond": 150}},
        "behavior": {
            "syncPeriodSeconds": 1,
            "stableWindowSeconds": 10,
            "panicWindowSeconds": 4,
            "warmupSeconds": 0,
            "scaleDown": {
                "stabilizationWindowSeconds": 8,
                "maxReplicasPerPeriod": 10,
                "periodSeconds": 1,
                "drainTimeoutSeconds": 0,
            },
        },
    }
)


def replay() -> list[tuple[float, int, Decision]]:
    """The recorded engine is the one ready pod; replicas the decisions add stay pending."""
    state, replicas, timeline = ScalerState(), 1, []
    for record in TRACE["samples"]:
        now = float(record["t"])
        sample = (
            None if "error" in record else engine_sample(parse("\n".join(record["metrics"])), now)
        )
        pods = [PodObservation("engine-0", -100.0, sample)]
        pods += [PodObservation(f"pending-{i}", None, None) for i in range(1, replicas)]
        decision = decide(SPEC, Observation(now, replicas, 1, 0, tuple(pods)), state)
        state, replicas = decision.state, decision.desired_replicas
        timeline.append((now, replicas, decision))
    return timeline


def test_recorded_load_step_scales_up_within_the_panic_window() -> None:
    timeline = replay()
    start = TRACE["phases"]["load_start"]
    first_tokens = min(t for t, _, d in timeline if d.signals[0].value)
    up = [t for t, r, _ in timeline if r > 1]
    assert up and up[0] <= first_tokens + SPEC.behavior.panic_window_seconds
    assert up[0] >= start
    peak = max(r for _, r, _ in timeline)
    assert 2 <= peak <= 4  # ~350 tok/s measured against 150 per replica


def test_recorded_noisy_load_does_not_flap() -> None:
    timeline = replay()
    start, end = TRACE["phases"]["load_start"], TRACE["phases"]["load_end"]
    during = [r for t, r, _ in timeline if start <= t <= end]
    decreases = sum(1 for a, b in itertools.pairwise(during) if b < a)
    assert decreases == 0  # the rate swings 120-560 tok/s; the replica count only grows


def test_recorded_load_end_scales_down_only_after_stabilization() -> None:
    timeline = replay()
    end = TRACE["phases"]["load_end"]
    peak = max(r for t, r, _ in timeline if t <= end)
    after = [(t, r) for t, r, _ in timeline if t > end]
    first_down = min(t for t, r in after if r < peak)
    assert first_down >= end + SPEC.behavior.scale_down.stabilization_window_seconds
    assert after[-1][1] == 1
