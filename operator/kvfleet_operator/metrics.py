"""The operator's own /metrics (`kvfleet operator --metrics-port`): what the Builtin autoscaler
saw and decided on each tick, per InferenceDeployment, for dashboards and alerts.

The series carry `namespace` and `inferencedeployment` of the InferenceDeployment, not of the
operator pod: scrape them with `honor_labels: true` (the chart's ServiceMonitor does).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvfleet_operator.autoscaling.decision import Decision
from kvfleet_operator.autoscaling.samples import Observation

REGISTRY = CollectorRegistry()
_LABELS = ("namespace", "inferencedeployment")

CURRENT_REPLICAS = Gauge(
    "kvfleet_autoscaler_current_replicas",
    "The child Deployment's spec.replicas when the autoscaler last looked",
    _LABELS,
    registry=REGISTRY,
)
READY_REPLICAS = Gauge(
    "kvfleet_autoscaler_ready_replicas",
    "Ready engine pods when the autoscaler last looked",
    _LABELS,
    registry=REGISTRY,
)
DESIRED_REPLICAS = Gauge(
    "kvfleet_autoscaler_desired_replicas",
    "Replicas the autoscaler decided on (written to the child Deployment)",
    _LABELS,
    registry=REGISTRY,
)
PANIC = Gauge(
    "kvfleet_autoscaler_panic_mode",
    "1 while the autoscaler is in panic mode (scales up only), else 0",
    _LABELS,
    registry=REGISTRY,
)
SIGNAL_VALUE = Gauge(
    "kvfleet_autoscaler_signal_value",
    "A signal's stable-window value per replica (latency signals: the percentile, seconds)",
    (*_LABELS, "signal"),
    registry=REGISTRY,
)
SIGNAL_TARGET = Gauge(
    "kvfleet_autoscaler_signal_target",
    "The per-replica target the signal is compared to",
    (*_LABELS, "signal"),
    registry=REGISTRY,
)
LEADING = Gauge(
    "kvfleet_operator_leading",
    "1 while this operator replica acts: it holds the leader-election Lease (always, without "
    "--leader-election); 0 on a standby",
    registry=REGISTRY,
)
SCALE_EVENTS = Counter(
    "kvfleet_autoscaler_scale_events",
    "Changes of the replica count the autoscaler made, by direction (up, down)",
    (*_LABELS, "direction"),
    registry=REGISTRY,
)


def record(namespace: str, name: str, decision: Decision, observation: Observation) -> None:
    """Export one tick's observation and decision."""
    labels = {"namespace": namespace, "inferencedeployment": name}
    CURRENT_REPLICAS.labels(**labels).set(observation.replicas)
    READY_REPLICAS.labels(**labels).set(observation.ready_replicas)
    DESIRED_REPLICAS.labels(**labels).set(decision.desired_replicas)
    PANIC.labels(**labels).set(1 if decision.mode == "Panic" else 0)
    for signal in decision.signals:
        SIGNAL_TARGET.labels(**labels, signal=signal.name).set(signal.target)
        if signal.value is not None:
            SIGNAL_VALUE.labels(**labels, signal=signal.name).set(signal.value)
    if decision.desired_replicas != observation.replicas:
        direction = "up" if decision.desired_replicas > observation.replicas else "down"
        SCALE_EVENTS.labels(**labels, direction=direction).inc()
    for direction in ("up", "down"):  # both series exist from the first tick (rate() of 0)
        SCALE_EVENTS.labels(**labels, direction=direction)


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Serve REGISTRY at http://<address>:<port>/metrics from a background thread."""
    if not 1 <= port <= 65535:
        raise ValueError(f"--metrics-port must be 1..65535, got {port}")
    start_http_server(port, addr=address, registry=REGISTRY)
