"""The autoscaling decision: a pure function of the spec, one observation and the saved state.

    decide(spec, observation, state) -> Decision

No clock, no cluster, no I/O: time arrives in `observation.now`, and everything that must
survive to the next tick (windows, stabilization history, scale events, panic, drain) leaves in
`Decision.state`. The formulas are in README.md, section "Autoscaling".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from kvfleet_operator.autoscaling.limits import rate_limit, stabilize
from kvfleet_operator.autoscaling.samples import Observation, PodObservation, RouterDemand
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.autoscaling.state import (
    HISTORY_LENGTH,
    Drain,
    ScaleEvent,
    ScalerState,
    Tick,
)
from kvfleet_operator.autoscaling.window import (
    LATENCY_SIGNALS,
    counted_pods,
    make_tick,
    quantile,
    snapshot,
    window_histogram,
    window_total,
)

Mode = Literal["Stable", "Panic"]

# ScalingLimited reasons (condition type ScalingLimited on the InferenceDeployment).
INSUFFICIENT_CAPACITY = "InsufficientCapacity"
METRICS_UNAVAILABLE = "MetricsUnavailable"
DESIRED_ABOVE_MAX = "DesiredAboveMax"
DESIRED_BELOW_MIN = "DesiredBelowMin"


@dataclass(frozen=True)
class SignalReading:
    """One signal in one decision, as status.autoscaling.signals shows it."""

    name: str  # camelCase target name, e.g. kvCacheUtilization
    value: float | None  # stable-window value per replica (latency: the percentile, seconds)
    target: float  # the per-replica target it is compared to
    desired: int | None  # replicas this signal alone asks for (stable window); None: no data
    panic_desired: int | None  # the same over the panic window, without tolerance
    panic_value: float | None  # the value over the panic window


@dataclass(frozen=True)
class Decision:
    """What to do now and what to remember."""

    desired_replicas: int  # write this to the child Deployment's spec.replicas
    mode: Mode  # Stable, or Panic (only grows)
    signals: tuple[SignalReading, ...]  # every configured signal
    reason: str  # why desired_replicas is what it is, in words
    limited: str  # ScalingLimited reason, "" when not limited
    victims: tuple[str, ...]  # pods to remove first on scale-down (least work in flight)
    state: ScalerState  # pass back in on the next tick


def decide(spec: AutoscalingSpec, observation: Observation, state: ScalerState) -> Decision:
    """One autoscaling step (see the module docstring)."""
    behavior = spec.behavior
    now = observation.now
    current = observation.replicas
    ready = observation.ready_replicas
    state = state.no_later_than(now, behavior.stable_window_seconds)

    tick = make_tick(spec, observation, state.snapshots)
    snapshots = {p.name: snapshot(p.sample) for p in observation.pods if p.sample is not None}
    ticks = tuple(t for t in (*state.ticks, tick) if t.time > now - behavior.stable_window_seconds)
    signals = _read_signals(spec, ticks, now, current, ready)
    state = replace(state, snapshots=snapshots, ticks=ticks)

    if spec.min_replicas == 0:
        to_or_from_zero = _zero(spec, observation, state, signals)
        if to_or_from_zero is not None:
            return to_or_from_zero
    if ready == 0 or not counted_pods(spec, observation):
        why = "no ready pods" if ready == 0 else "no metrics from ready pods past warm-up"
        return _hold(spec, observation, state, signals, why)
    missing = [s.name for s in signals if s.desired is None and s.name not in LATENCY_SIGNALS]
    with_data = [s for s in signals if s.desired is not None]
    if missing and not with_data:
        return _hold(spec, observation, state, signals, f"no data yet for {', '.join(missing)}")

    stable = max((s.desired for s in with_data if s.desired is not None), default=spec.min_replicas)
    panic = max((s.panic_desired for s in with_data if s.panic_desired is not None), default=stable)
    if panic >= behavior.panic_threshold * ready:
        state = replace(state, panic_until=now + behavior.stable_window_seconds)
    mode: Mode = "Panic" if now < state.panic_until else "Stable"

    if mode == "Panic":
        recommendation = max(panic, stable, current)
        reason = f"panic: {_top(with_data, panic=True)}"
    else:
        recommendation = stable
        reason = _top(with_data, panic=False) if with_data else "no load"
    if missing and recommendation < current:
        recommendation = current
        reason = f"hold: no data for {', '.join(missing)}"

    limited = ""
    if recommendation > spec.max_replicas:
        limited = DESIRED_ABOVE_MAX
    elif recommendation < spec.min_replicas:
        limited = DESIRED_BELOW_MIN
    recommendation = _clamp(spec, recommendation)

    state, desired = stabilize(spec, state, now, current, recommendation)
    if desired != recommendation:
        reason += f"; stabilized at {desired}"
    desired, rate_note = rate_limit(spec, state, now, current, desired)
    if rate_note:
        reason += f"; {rate_note}"

    if desired > current:
        if observation.unschedulable_replicas > 0:
            desired, limited = current, INSUFFICIENT_CAPACITY
            reason = (
                f"hold: {observation.unschedulable_replicas} replica(s) Unschedulable; "
                f"not asking for more than {current}"
            )
        elif current > ready and mode == "Stable":
            desired = current
            reason = f"hold: {current - ready} replica(s) pending; {reason}"
    return _finish(spec, observation, state, signals, mode, desired, reason, limited)


def _read_signals(
    spec: AutoscalingSpec, ticks: tuple[Tick, ...], now: float, current: int, ready: int
) -> tuple[SignalReading, ...]:
    """Every configured signal over the stable and panic windows."""
    behavior = spec.behavior
    targets = spec.targets
    readings = []
    per_replica = {
        "generationTokenRate": targets.generation_token_rate,
        "promptTokenRate": targets.prompt_token_rate,
        "kvCacheUtilization": targets.kv_cache_utilization,
        "waitingRequestsPerReplica": targets.waiting_requests_per_replica,
    }
    for name, target_spec in per_replica.items():
        if target_spec is None:
            continue
        if isinstance(target_spec, float | int):
            target = float(target_spec)
        else:
            target = target_spec.tokens_per_second or target_spec.capacity_fraction or 0.0
        totals = [
            window_total(ticks, name, now - window)
            for window in (behavior.stable_window_seconds, behavior.panic_window_seconds)
        ]
        desired = (
            None
            if totals[0] is None
            else _desired_from_total(totals[0], target, current, ready, spec),
            None if totals[1] is None else math.ceil(totals[1] / target - 1e-9),
        )
        value, panic_value = (
            None if total is None or ready == 0 else total / ready for total in totals
        )
        readings.append(SignalReading(name, value, target, desired[0], desired[1], panic_value))
    for name in LATENCY_SIGNALS:
        latency = getattr(targets, name)
        if latency is None:
            continue
        values = []
        for window in (behavior.stable_window_seconds, behavior.panic_window_seconds):
            histogram = window_histogram(ticks, name, now - window)
            values.append(None if histogram is None else quantile(histogram, latency.quantile))
        desired = (
            None
            if values[0] is None
            else _desired_from_ratio(values[0] / latency.seconds, current, ready, spec),
            None if values[1] is None else math.ceil(ready * values[1] / latency.seconds - 1e-9),
        )
        readings.append(
            SignalReading(name, values[0], latency.seconds, desired[0], desired[1], values[1])
        )
    return tuple(readings)


def _desired_from_total(
    total: float, target: float, current: int, ready: int, spec: AutoscalingSpec
) -> int:
    """ceil(fleet total / per-replica target), unless within tolerance of the target."""
    if ready > 0 and abs(total / (ready * target) - 1) <= spec.behavior.tolerance:
        return current
    return math.ceil(total / target - 1e-9)


def _desired_from_ratio(ratio: float, current: int, ready: int, spec: AutoscalingSpec) -> int:
    """ceil(ready x value / target) for signals that do not add up across replicas."""
    if abs(ratio - 1) <= spec.behavior.tolerance:
        return current
    return math.ceil(ready * ratio - 1e-9)


def _top(signals: list[SignalReading], panic: bool) -> str:
    """The signal that asks for the most replicas, in words."""
    if not signals:
        return "no signal has data"
    if panic:
        top = max(signals, key=lambda s: s.panic_desired or 0)
        value, desired = top.panic_value, top.panic_desired
    else:
        top = max(signals, key=lambda s: s.desired or 0)
        value, desired = top.value, top.desired
    shown = "n/a" if value is None else f"{value:.3g}"
    return f"{top.name} {shown}/{top.target:.3g} per replica -> {desired}"


def _zero(
    spec: AutoscalingSpec,
    observation: Observation,
    state: ScalerState,
    signals: tuple[SignalReading, ...],
) -> Decision | None:
    """With minReplicas 0: from zero to one as soon as a request waits in the router, to zero
    once the router has been idle for routing.scaleToZeroAfterSeconds. Neither waits for
    stabilization or rate limits: the idle time is the scale-down window, and a request that
    waits needs a replica now. None: decide as usual (never below one replica)."""
    current = observation.replicas
    demand = observation.demand
    if current == 0:
        if demand is None:
            return _finish(
                spec, observation, state, signals, "Stable", 0,
                "hold at zero: no demand signal from the router", METRICS_UNAVAILABLE,
            )  # fmt: skip
        if demand.queued > 0 or demand.in_flight > 0:
            waiting = _count(demand)
            return _finish(
                spec, observation, state, signals, "Stable", 1,
                f"scale from zero: {waiting} waiting in the router", "",
            )  # fmt: skip
        return _finish(spec, observation, state, signals, "Stable", 0, "at zero: no requests", "")
    idle_after = observation.scale_to_zero_after_s
    if demand is None or idle_after is None or not _idle(demand, idle_after):
        return None
    return _finish(
        spec, observation, state, signals, "Stable", 0,
        f"scale to zero: no request through the router for {demand.idle_seconds:.0f} s "
        f"(routing.scaleToZeroAfterSeconds {idle_after:g})", "",
    )  # fmt: skip


def _idle(demand: RouterDemand, idle_after: float) -> bool:
    return demand.queued == 0 and demand.in_flight == 0 and demand.idle_seconds >= idle_after


def _count(demand: RouterDemand) -> str:
    return f"{demand.queued:g} queued, {demand.in_flight:g} in flight"


def _clamp(spec: AutoscalingSpec, replicas: int, allow_zero: bool = False) -> int:
    """Within [minReplicas, maxReplicas]; never 0 unless the zero rule decided it."""
    floor = spec.min_replicas if allow_zero else max(1, spec.min_replicas)
    return max(floor, min(spec.max_replicas, replicas))


def _hold(
    spec: AutoscalingSpec,
    observation: Observation,
    state: ScalerState,
    signals: tuple[SignalReading, ...],
    why: str,
) -> Decision:
    """Keep the current count (within min/max): the metrics cannot support a decision."""
    return _finish(
        spec,
        observation,
        state,
        signals,
        "Stable",
        observation.replicas,
        f"hold: {why}",
        METRICS_UNAVAILABLE,
    )


def _finish(
    spec: AutoscalingSpec,
    observation: Observation,
    state: ScalerState,
    signals: tuple[SignalReading, ...],
    mode: Mode,
    desired: int,
    reason: str,
    limited: str,
) -> Decision:
    """Apply min/max, the scale-down drain, and record the decision."""
    now, current = observation.now, observation.replicas
    clamped = _clamp(spec, desired, allow_zero=desired == 0 and spec.min_replicas == 0)
    if clamped != desired:
        reason = f"{reason}; clamped to [{spec.min_replicas}, {spec.max_replicas}]"
        desired = clamped
    victims: tuple[str, ...] = ()
    drain = None
    if desired < current:
        victims, busy = _pick_victims(observation, current - desired)
        previous = state.drain
        started = previous.started if previous and previous.to_replicas == desired else now
        waited = now - started
        if busy and waited < spec.behavior.scale_down.drain_timeout_seconds:
            drain = Drain(started, desired, victims)
            reason = (
                f"draining {', '.join(victims)} ({busy:g} requests in flight) before "
                f"scaling {current} -> {desired}; {reason}"
            )
            desired = current
    state = replace(state, drain=drain)
    events = state.events
    noteworthy = {INSUFFICIENT_CAPACITY, METRICS_UNAVAILABLE}
    if desired != current or (limited != state.limited and {limited, state.limited} & noteworthy):
        told = f"[{limited}] {reason}" if limited else reason
        events = (*events, ScaleEvent(now, current, desired, told))[-HISTORY_LENGTH:]
    state = replace(state, events=events, limited=limited)
    return Decision(desired, mode, signals, reason, limited, victims, state)


def _pick_victims(observation: Observation, count: int) -> tuple[tuple[str, ...], float]:
    """The `count` pods to remove: pods that are not ready first, then pods whose engine does not
    answer (still loading: it serves nothing), then ready pods with the least work in flight.
    Returns them and the requests still in flight on them."""

    def rank(pod: PodObservation) -> tuple[int, float, str]:
        if pod.ready_since is None:
            return (0, 0.0, pod.name)
        if pod.sample is None:
            return (1, 0.0, pod.name)
        return (2, pod.sample.in_flight, pod.name)

    chosen = sorted(observation.pods, key=rank)[:count]
    busy = sum(pod.sample.in_flight for pod in chosen if pod.sample is not None)
    return tuple(pod.name for pod in chosen), busy
