"""Turn one tick of pod samples into fleet aggregates, and average aggregates over a window.

Per-replica signals (token rates, KV utilization, waiting requests) are kept as a *fleet total
estimate*: the mean over the pods that count (ready, past warm-up, metrics read) times the number
of ready pods. Pods still warming up serve their share of the load but their own numbers are not
trusted yet; the estimate gives them the average share. Latency signals keep the histogram
increments, so a window's percentile is computed from all requests in it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from kvfleet_operator.autoscaling.samples import Buckets, EngineSample, Observation
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.autoscaling.state import CounterSnapshot, Tick

LATENCY_SIGNALS = ("ttft", "tpot")


def snapshot(sample: EngineSample) -> CounterSnapshot:
    """The counters of `sample`, kept until the next tick."""
    return CounterSnapshot(
        sample.time,
        sample.generation_tokens_total,
        sample.prompt_tokens_total,
        sample.ttft_buckets,
        sample.tpot_buckets,
    )


def counted_pods(spec: AutoscalingSpec, observation: Observation) -> list[tuple[str, EngineSample]]:
    """Pods whose numbers count: ready for at least the warm-up period, metrics read."""
    warmup = spec.behavior.warmup_seconds
    return [
        (pod.name, pod.sample)
        for pod in observation.pods
        if pod.sample is not None
        and pod.ready_since is not None
        and observation.now - pod.ready_since >= warmup
    ]


def make_tick(
    spec: AutoscalingSpec,
    observation: Observation,
    snapshots: dict[str, CounterSnapshot],
) -> Tick:
    """Fleet aggregates of this tick for every configured signal that has data."""
    counted = counted_pods(spec, observation)
    targets = spec.targets
    per_pod: dict[str, list[float]] = {}
    histograms: dict[str, Buckets] = {}

    def add(signal: str, value: float | None) -> None:
        if value is not None:
            per_pod.setdefault(signal, []).append(value)

    for name, sample in counted:
        previous = snapshots.get(name)
        if targets.kv_cache_utilization is not None:
            add("kvCacheUtilization", sample.kv_cache_usage)
        if targets.waiting_requests_per_replica is not None:
            add("waitingRequestsPerReplica", sample.requests_waiting)
        if previous is None or sample.time <= previous.time:
            continue
        elapsed = sample.time - previous.time
        for signal, target, now_total, then_total, capacity in (
            (
                "generationTokenRate",
                targets.generation_token_rate,
                sample.generation_tokens_total,
                previous.generation_tokens_total,
                sample.capacity_generation,
            ),
            (
                "promptTokenRate",
                targets.prompt_token_rate,
                sample.prompt_tokens_total,
                previous.prompt_tokens_total,
                sample.capacity_prompt,
            ),
        ):
            if target is None or now_total < then_total:  # counter reset: engine restarted
                continue
            rate = (now_total - then_total) / elapsed
            if target.capacity_fraction is None:
                add(signal, rate)
            elif capacity is not None:
                add(signal, rate / capacity)  # in units of one replica's capacity
        for signal, now_buckets, then_buckets in (
            ("ttft", sample.ttft_buckets, previous.ttft_buckets),
            ("tpot", sample.tpot_buckets, previous.tpot_buckets),
        ):
            if getattr(targets, signal) is None:
                continue
            increment = _subtract(now_buckets, then_buckets)
            if increment is not None:
                histograms[signal] = _add(histograms.get(signal, ()), increment)
    ready = max(observation.ready_replicas, len(counted))
    totals = {signal: sum(values) / len(values) * ready for signal, values in per_pod.items()}
    return Tick(observation.now, totals, histograms)


def window_total(ticks: Sequence[Tick], signal: str, since: float) -> float | None:
    """Mean of the signal's fleet totals over ticks after `since`; None when no tick has it."""
    values = [t.totals[signal] for t in ticks if t.time > since and signal in t.totals]
    return sum(values) / len(values) if values else None


def window_histogram(ticks: Sequence[Tick], signal: str, since: float) -> Buckets | None:
    """Sum of the signal's histogram increments over ticks after `since`; None without data."""
    parts = [t.histograms[signal] for t in ticks if t.time > since and signal in t.histograms]
    if not parts:
        return None
    merged: Buckets = ()
    for part in parts:
        merged = _add(merged, part)
    return merged


def quantile(buckets: Buckets, q: float) -> float | None:
    """`histogram_quantile` as Prometheus computes it (linear inside the bucket); None when the
    histogram holds no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound  # beyond the last finite bound: report that bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def _subtract(now: Buckets, then: Buckets) -> Buckets | None:
    """Increments between two reads of a cumulative histogram; None after a reset."""
    previous = dict(then)
    increment = []
    for le, count in now:
        delta = count - previous.get(le, 0.0)
        if delta < 0:
            return None
        increment.append((le, delta))
    return tuple(increment)


def _add(left: Iterable[tuple[float, float]], right: Iterable[tuple[float, float]]) -> Buckets:
    merged: dict[float, float] = {}
    for le, count in (*left, *right):
        merged[le] = merged.get(le, 0.0) + count
    return tuple(sorted(merged.items()))
