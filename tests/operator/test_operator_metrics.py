"""The operator's /metrics: one autoscaler tick as a Prometheus scrape shows it."""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_operator import metrics
from kvfleet_operator.autoscaling.decision import Decision, SignalReading
from kvfleet_operator.autoscaling.samples import Observation
from kvfleet_operator.autoscaling.state import ScalerState


def _decision(desired: int, value: float | None) -> Decision:
    signal = SignalReading("generationTokenRate", value, 280.0, desired, desired, value)
    return Decision(desired, "Stable", (signal,), "generationTokenRate", "", (), ScalerState())


def _observation(replicas: int, ready: int) -> Observation:
    return Observation(now=0.0, replicas=replicas, ready_replicas=ready,
                       unschedulable_replicas=0, pods=())  # fmt: skip


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_scale_up_then_a_steady_tick_read_as_replicas_signals_and_one_event() -> None:
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics.serve(port, "127.0.0.1")
    metrics.record("team-a", "llama", _decision(3, 700.0), _observation(1, 1))
    metrics.record("team-a", "llama", _decision(3, None), _observation(3, 2))

    scraped = _scrape(port)
    ids = (("inferencedeployment", "llama"), ("namespace", "team-a"))
    signal = (*ids, ("signal", "generationTokenRate"))
    assert scraped[("kvfleet_autoscaler_desired_replicas", ids)] == 3
    assert scraped[("kvfleet_autoscaler_current_replicas", ids)] == 3
    assert scraped[("kvfleet_autoscaler_ready_replicas", ids)] == 2
    assert scraped[("kvfleet_autoscaler_panic_mode", ids)] == 0
    assert scraped[("kvfleet_autoscaler_signal_target", signal)] == 280.0
    assert scraped[("kvfleet_autoscaler_signal_value", signal)] == 700.0  # last value with data
    assert scraped[("kvfleet_autoscaler_scale_events_total", (("direction", "up"), *ids))] == 1
    assert scraped[("kvfleet_autoscaler_scale_events_total", (("direction", "down"), *ids))] == 0


def test_a_port_out_of_range_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--metrics-port must be 1\.\.65535, got 70000"):
        metrics.serve(70000)
