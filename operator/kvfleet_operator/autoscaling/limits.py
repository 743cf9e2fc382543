"""Stabilization and rate limits (HPA v2 `behavior` semantics), pure: they turn a recommendation
into the replica count that may be written now."""

from __future__ import annotations

import math
from dataclasses import replace

from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.autoscaling.state import ScalerState


def stabilize(
    spec: AutoscalingSpec, state: ScalerState, now: float, current: int, recommendation: int
) -> tuple[ScalerState, int]:
    """HPA stabilization: scale up to the lowest recommendation of the scale-up window, down to
    the highest recommendation of the scale-down window."""
    up = spec.behavior.scale_up.stabilization_window_seconds
    down = spec.behavior.scale_down.stabilization_window_seconds
    keep = max(up, down)
    history = tuple(r for r in state.recommendations if r[0] > now - keep)
    history = (*history, (now, recommendation))
    up_recommendation = min(r for t, r in history if t > now - up or t == now)
    down_recommendation = max(r for t, r in history if t > now - down or t == now)
    desired = current
    if desired < up_recommendation:
        desired = up_recommendation
    if desired > down_recommendation:
        desired = down_recommendation
    return replace(state, recommendations=history), desired


def rate_limit(
    spec: AutoscalingSpec, state: ScalerState, now: float, current: int, desired: int
) -> tuple[int, str]:
    """HPA-style policies: within one period, change by at most max(replicas, percent) of the
    replica count at the start of the period."""
    if desired > current:
        rules_up = spec.behavior.scale_up
        start = _replicas_at(state, now - rules_up.period_seconds, current)
        allowed = start + max(
            rules_up.max_replicas_per_period,
            math.ceil(start * rules_up.max_percent_per_period / 100),
        )
        if desired > allowed:
            return max(current, allowed), f"scale-up limited to {max(current, allowed)}"
    elif desired < current:
        rules_down = spec.behavior.scale_down
        start = _replicas_at(state, now - rules_down.period_seconds, current)
        allowed = start - max(
            rules_down.max_replicas_per_period,
            math.floor(start * rules_down.max_percent_per_period / 100),
        )
        if desired < allowed:
            return min(current, allowed), f"scale-down limited to {min(current, allowed)}"
    return desired, ""


def _replicas_at(state: ScalerState, since: float, current: int) -> int:
    """Replica count before the scale events after `since`."""
    replicas = current
    for event in reversed(state.events):
        if event.time <= since:
            break
        replicas = event.from_replicas
    return replicas
