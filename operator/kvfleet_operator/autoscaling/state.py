"""The autoscaler's memory between ticks, kept in `status.autoscaling.state` so an operator
restart picks up the windows, stabilization history and recent decisions where they were."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvfleet_operator.autoscaling.samples import Buckets

HISTORY_LENGTH = 10  # decisions kept in status.autoscaling.history


@dataclass(frozen=True)
class CounterSnapshot:
    """A pod's counters at its previous read, to turn counters into rates."""

    time: float  # when they were read
    generation_tokens_total: float  # kvfleet_generation_tokens_total
    prompt_tokens_total: float  # kvfleet_prompt_tokens_total
    ttft_buckets: Buckets  # cumulative TTFT histogram
    tpot_buckets: Buckets  # cumulative TPOT histogram


@dataclass(frozen=True)
class Tick:
    """Fleet-wide aggregates of one tick, the unit the stable and panic windows average over."""

    time: float  # tick time
    totals: dict[str, float]  # per-replica signal -> fleet total (mean over counted pods x ready)
    histograms: dict[str, Buckets]  # latency signal -> histogram increments in this tick


@dataclass(frozen=True)
class ScaleEvent:
    """A change of the child Deployment's replicas, for rate limits and the status history."""

    time: float  # when it was decided
    from_replicas: int  # replicas before
    to_replicas: int  # replicas after
    reason: str  # why, in words a user reads in status


@dataclass(frozen=True)
class Drain:
    """A scale-down that waits for the chosen pods to finish their work."""

    started: float  # when the wait began
    to_replicas: int  # the replica count it will write
    victims: tuple[str, ...]  # pods chosen for removal (least work in flight)


@dataclass(frozen=True)
class ScalerState:
    """Everything a decision needs from earlier decisions. Empty on the first tick."""

    snapshots: dict[str, CounterSnapshot] = field(default_factory=dict)  # pod -> last counters
    ticks: tuple[Tick, ...] = ()  # within the stable window, oldest first
    recommendations: tuple[tuple[float, int], ...] = ()  # (time, replicas) for stabilization
    events: tuple[ScaleEvent, ...] = ()  # the last HISTORY_LENGTH scale events
    panic_until: float = 0.0  # panic mode lasts until this time
    drain: Drain | None = None  # a scale-down waiting on pods to drain
    limited: str = ""  # the current ScalingLimited reason, "" when not limited

    def no_later_than(self, now: float, panic_seconds: float) -> ScalerState:
        """The state with every time after `now` moved back to `now` (panic: to at most
        `panic_seconds` after it). The clock stepped back (an NTP step, an operator restarted on
        a node whose clock is behind): what was recorded "later" then held the windows,
        stabilization, panic and drains for as long as the step, an hour for an hour; now it
        counts as just recorded and ages out within one window, as it would have."""
        if now >= self.latest():
            return self
        drain = self.drain
        return replace(
            self,
            snapshots={pod: replace(s, time=min(s.time, now)) for pod, s in self.snapshots.items()},
            ticks=tuple(replace(t, time=min(t.time, now)) for t in self.ticks),
            recommendations=tuple((min(t, now), r) for t, r in self.recommendations),
            events=tuple(replace(e, time=min(e.time, now)) for e in self.events),
            panic_until=min(self.panic_until, now + panic_seconds),
            drain=None if drain is None else replace(drain, started=min(drain.started, now)),
        )

    def latest(self) -> float:
        """The latest time the state records (panic_until aside: it is meant to be ahead)."""
        times = [
            *(s.time for s in self.snapshots.values()),
            *(t.time for t in self.ticks),
            *(t for t, _ in self.recommendations),
            *(e.time for e in self.events),
            *(() if self.drain is None else (self.drain.started,)),
        ]
        return max(times, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible form for the status subresource."""
        return {
            # A list, not a map: status is written by JSON merge patch, which would keep the
            # keys of pods that are gone.
            "snapshots": [
                [
                    pod,
                    s.time,
                    s.generation_tokens_total,
                    s.prompt_tokens_total,
                    _pairs(s.ttft_buckets),
                    _pairs(s.tpot_buckets),
                ]
                for pod, s in self.snapshots.items()
            ],
            "ticks": [
                [t.time, t.totals, {k: _pairs(v) for k, v in t.histograms.items()}]
                for t in self.ticks
            ],
            "recommendations": [list(r) for r in self.recommendations],
            "events": [[e.time, e.from_replicas, e.to_replicas, e.reason] for e in self.events],
            "panicUntil": self.panic_until,
            "drain": None
            if self.drain is None
            else [self.drain.started, self.drain.to_replicas, list(self.drain.victims)],
            "limited": self.limited,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ScalerState:
        """Inverse of to_dict; an absent or unreadable state starts empty (the decision then
        holds until the windows fill again, which is the safe direction)."""
        if not data:
            return cls()
        try:
            drain = data.get("drain")
            return cls(
                snapshots={
                    str(s[0]): CounterSnapshot(
                        float(s[1]), float(s[2]), float(s[3]), _buckets(s[4]), _buckets(s[5])
                    )
                    for s in data.get("snapshots", [])
                },
                ticks=tuple(
                    Tick(
                        float(t[0]),
                        {k: float(v) for k, v in t[1].items()},
                        {k: _buckets(v) for k, v in t[2].items()},
                    )
                    for t in data.get("ticks", [])
                ),
                recommendations=tuple(
                    (float(r[0]), int(r[1])) for r in data.get("recommendations", [])
                ),
                events=tuple(
                    ScaleEvent(float(e[0]), int(e[1]), int(e[2]), str(e[3]))
                    for e in data.get("events", [])
                ),
                panic_until=float(data.get("panicUntil", 0.0)),
                drain=None
                if not drain
                else Drain(float(drain[0]), int(drain[1]), tuple(str(p) for p in drain[2])),
                limited=str(data.get("limited", "")),
            )
        except (TypeError, ValueError, IndexError, KeyError, AttributeError):
            return cls()


def _pairs(buckets: Buckets) -> list[list[float | str]]:
    # JSON (and so the API server) has no infinity: the +Inf bucket travels as a string.
    return [[le if math.isfinite(le) else "+Inf", count] for le, count in buckets]


def _buckets(pairs: list[list[Any]]) -> Buckets:
    return tuple((float(le), float(count)) for le, count in pairs)
