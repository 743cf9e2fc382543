"""A simulated fleet of engines for autoscaler tests: demand (tokens/s) is spread evenly over the
ready pods, counters grow with it, pods become ready `startup` seconds after they are asked for.
Every tick runs the real decision function and applies its answer, like the operator does; the
state goes through JSON each tick, as it does through the status subresource."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet_operator.autoscaling.decision import Decision, decide
from kvfleet_operator.autoscaling.samples import EngineSample, Observation, PodObservation
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.autoscaling.state import ScalerState


@dataclass
class SimPod:
    name: str
    created: float
    generated: float = 0.0
    prompted: float = 0.0


@dataclass
class Fleet:
    spec: AutoscalingSpec
    demand: Callable[[float], float]  # tokens/s the clients want at time t
    capacity: float = 400.0  # tokens/s one engine could do (kvfleet_engine_capacity_...)
    startup: float = 20.0  # seconds from scale-up to ready
    replicas: int = 1
    scrape_fails: Callable[[float], bool] = lambda t: False
    unschedulable_above: int | None = None  # pods past this count never get scheduled
    state: ScalerState = field(default_factory=ScalerState)
    pods: list[SimPod] = field(default_factory=list)
    timeline: list[tuple[float, int, Decision]] = field(default_factory=list)
    counter: int = 0

    def __post_init__(self) -> None:
        for _ in range(self.replicas):
            self._add_pod(-3600.0)

    def _add_pod(self, now: float) -> None:
        self.counter += 1
        self.pods.append(SimPod(f"pod-{self.counter}", now))

    def _schedulable(self, index: int) -> bool:
        return self.unschedulable_above is None or index < self.unschedulable_above

    def _ready(self, now: float) -> list[SimPod]:
        return [
            p
            for i, p in enumerate(self.pods)
            if self._schedulable(i) and now - p.created >= self.startup
        ]

    def run(self, until: float, start: float = 0.0) -> None:
        dt = self.spec.behavior.sync_period_seconds
        now = start
        while now <= until:
            self.tick(now, dt)
            now += dt

    def tick(self, now: float, dt: float) -> Decision:
        ready = self._ready(now)
        per_pod = self.demand(now) / max(1, len(ready))
        for pod in ready:
            pod.generated += per_pod * dt
            pod.prompted += 2 * per_pod * dt
        observed = []
        for pod in self.pods:
            is_ready = pod in ready
            sample = None
            if is_ready and not self.scrape_fails(now):
                sample = EngineSample(
                    time=now,
                    generation_tokens_total=pod.generated,
                    prompt_tokens_total=pod.prompted,
                    kv_cache_usage=min(1.0, per_pod / self.capacity),
                    requests_waiting=max(0.0, (per_pod - self.capacity) / 10),
                    requests_running=per_pod / 50,
                    capacity_generation=self.capacity,
                    capacity_prompt=2 * self.capacity,
                )
            ready_since = pod.created + self.startup if is_ready else None
            observed.append(PodObservation(pod.name, ready_since, sample))
        unschedulable = sum(1 for i in range(len(self.pods)) if not self._schedulable(i))
        observation = Observation(now, self.replicas, len(ready), unschedulable, tuple(observed))
        decision = decide(self.spec, observation, self.state)
        self.state = ScalerState.from_dict(json.loads(json.dumps(decision.state.to_dict())))
        self._apply(now, decision)
        self.timeline.append((now, self.replicas, decision))
        return decision

    def _apply(self, now: float, decision: Decision) -> None:
        desired = decision.desired_replicas
        while len(self.pods) < desired:
            self._add_pod(now)
        if desired < len(self.pods):
            victims = set(decision.victims)
            self.pods = [p for p in self.pods if p.name not in victims]
            del self.pods[desired:]
        self.replicas = desired

    def replicas_at(self, time: float) -> int:
        at = [r for t, r, _ in self.timeline if t <= time]
        return at[-1] if at else self.replicas

    def scale_events(self, after: float = float("-inf")) -> int:
        changes, previous = 0, None
        for t, replicas, _ in self.timeline:
            if previous is not None and replicas != previous and t > after:
                changes += 1
            previous = replicas
        return changes
