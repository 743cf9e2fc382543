"""What the autoscaler observes on each tick: one metrics sample per pod plus replica counts.
Plain frozen records; the decision function reads nothing else (no clock, no cluster)."""

from __future__ import annotations

from dataclasses import dataclass

# A cumulative histogram: ((upper bound `le`, cumulative count), ...) sorted by bound, +Inf last.
Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class EngineSample:
    """One read of one engine's metrics."""

    time: float  # when it was read, seconds since the epoch
    generation_tokens_total: float  # counter kvfleet_generation_tokens_total
    prompt_tokens_total: float  # counter kvfleet_prompt_tokens_total
    kv_cache_usage: float  # gauge kvfleet_kv_cache_usage_ratio, 0-1
    requests_waiting: float  # gauge kvfleet_requests_waiting
    requests_running: float  # gauge kvfleet_requests_running
    capacity_generation: float | None  # kvfleet_engine_capacity_tokens_per_second (generation)
    capacity_prompt: float | None  # kvfleet_engine_capacity_tokens_per_second (prompt)
    ttft_buckets: Buckets = ()  # kvfleet_time_to_first_token_seconds_bucket
    tpot_buckets: Buckets = ()  # kvfleet_inter_token_latency_seconds_bucket

    @property
    def in_flight(self) -> float:
        """Requests running or waiting: the work a scale-down would have to drain."""
        return self.requests_running + self.requests_waiting


@dataclass(frozen=True)
class RouterDemand:
    """What the InferenceDeployment's routers report (summed over router pods): the demand
    signal that scales from zero and to zero."""

    queued: float  # kvfleet_router_queued_requests: requests waiting for a replica
    in_flight: float  # kvfleet_router_requests_in_flight
    idle_seconds: float  # kvfleet_router_idle_seconds (the least over router pods)


@dataclass(frozen=True)
class PodObservation:
    """One pod of the child Deployment."""

    name: str  # pod name
    ready_since: float | None  # when its Ready condition turned True; None while not ready
    sample: EngineSample | None  # its metrics; None when the read failed


@dataclass(frozen=True)
class Observation:
    """Everything one decision looks at."""

    now: float  # decision time, seconds since the epoch
    replicas: int  # the child Deployment's spec.replicas (what was last asked for)
    ready_replicas: int  # its status.readyReplicas
    unschedulable_replicas: int  # pods the scheduler reports Unschedulable
    pods: tuple[PodObservation, ...]  # pods of the Deployment (not terminating)
    demand: RouterDemand | None = None  # from the routers; None: no router, or no answer
    scale_to_zero_after_s: float | None = None  # routing.scaleToZeroAfterSeconds with a router
