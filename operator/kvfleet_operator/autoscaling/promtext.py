"""Parse the Prometheus text exposition format (what an engine's /metrics returns) into samples,
and read the kvfleet metric contract out of them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvfleet_operator.autoscaling.samples import EngineSample, RouterDemand

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Sample:
    """One line of the exposition format."""

    name: str  # metric name, e.g. kvfleet_generation_tokens_total
    labels: dict[str, str]  # label name -> unescaped value
    value: float  # sample value (+Inf/-Inf/NaN allowed)


class ParseError(ValueError):
    """The text is not in the Prometheus exposition format."""


def parse(text: str) -> list[Sample]:
    """Every sample line of `text`; comments and blank lines skipped."""
    samples = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ParseError(f"line {number}: not a metric sample: {line[:80]!r}")
        name, label_text, value_text = match.groups()
        try:
            value = float(value_text)
        except ValueError:
            raise ParseError(f"line {number}: bad value {value_text!r}") from None
        samples.append(Sample(name, _parse_labels(label_text or "", number), value))
    return samples


def _parse_labels(text: str, number: int) -> dict[str, str]:
    inner = text[1:-1] if text else ""
    labels: dict[str, str] = {}
    position = 0
    while position < len(inner):
        match = _LABEL.match(inner, position)
        if match is None:
            if inner[position:].strip():
                raise ParseError(f"line {number}: bad labels {text[:80]!r}")
            break
        value = match.group(2).replace("\\\\", "\0").replace('\\"', '"').replace("\\n", "\n")
        labels[match.group(1)] = value.replace("\0", "\\")
        position = match.end()
    return labels


# The metric contract (README "Metrics"): what the autoscaler reads from each engine.
GENERATION_TOKENS = "kvfleet_generation_tokens_total"
PROMPT_TOKENS = "kvfleet_prompt_tokens_total"
KV_CACHE_USAGE = "kvfleet_kv_cache_usage_ratio"
REQUESTS_WAITING = "kvfleet_requests_waiting"
REQUESTS_RUNNING = "kvfleet_requests_running"
CAPACITY = "kvfleet_engine_capacity_tokens_per_second"
TTFT = "kvfleet_time_to_first_token_seconds"
TPOT = "kvfleet_inter_token_latency_seconds"

# What the autoscaler reads from each `kvfleet router` pod (README "Router").
ROUTER_QUEUED = "kvfleet_router_queued_requests"
ROUTER_IN_FLIGHT = "kvfleet_router_requests_in_flight"
ROUTER_IDLE = "kvfleet_router_idle_seconds"
# The series each reader cannot do without: absent, not finite or negative, the pod has no data
# (each is a count, a counter or a ratio: below zero it is a broken exporter, not an idle one).
_ENGINE_REQUIRED = (GENERATION_TOKENS, PROMPT_TOKENS, KV_CACHE_USAGE, REQUESTS_WAITING)
_ROUTER_REQUIRED = (ROUTER_QUEUED, ROUTER_IN_FLIGHT, ROUTER_IDLE)

# Label values of CAPACITY that mean prompt (prefill) or generation (decode) capacity; the kvfleet
# engine exports only generation capacity, without such a label.
_PROMPT_KINDS = {"prompt", "prefill"}
_GENERATION_KINDS = {"generation", "decode"}


# A KV-cache usage ratio above 1 by more than rounding is not one (a percentage, a count).
_RATIO_SLACK = 1e-6


def engine_sample(samples: list[Sample], time: float) -> EngineSample:
    """The autoscaler's view of one engine's /metrics. Raises ParseError when a metric the
    autoscaler needs is absent, not a finite number (NaN, ±Inf), negative, or (the KV-cache
    ratio) above 1, or when its series add up past what a float holds, so a wrong target or a
    broken exporter shows up as missing metrics (the pod has no data), never as zero load, as
    load to scale up for, or as a crash."""
    totals: dict[str, float] = {}
    capacity_prompt = capacity_generation = None
    ttft: dict[float, float] = {}
    tpot: dict[float, float] = {}
    _require_sane(samples, _ENGINE_REQUIRED)
    for sample in samples:
        if sample.name == KV_CACHE_USAGE and sample.value > 1 + _RATIO_SLACK:
            raise ParseError(f"{sample.name} is {sample.value:g} (not a ratio from 0 to 1)")
        if not math.isfinite(sample.value) or sample.value < 0:  # optional series: left out
            continue
        if sample.name in (GENERATION_TOKENS, PROMPT_TOKENS, REQUESTS_WAITING, REQUESTS_RUNNING):
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        elif sample.name == KV_CACHE_USAGE:
            totals[sample.name] = max(totals.get(sample.name, 0.0), sample.value)
        elif sample.name == CAPACITY:
            kind = (
                sample.labels.get("kind")
                or sample.labels.get("phase")
                or sample.labels.get("type")
                or ""
            ).lower()
            if kind in _PROMPT_KINDS:
                capacity_prompt = sample.value
            elif kind in _GENERATION_KINDS:
                capacity_generation = sample.value
            elif not kind:  # the engine's own metric: generation capacity
                capacity_generation = sample.value
        elif sample.name in (TTFT + "_bucket", TPOT + "_bucket") and "le" in sample.labels:
            buckets = ttft if sample.name.startswith(TTFT) else tpot
            le = float(sample.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + sample.value
    missing = [name for name in _ENGINE_REQUIRED if name not in totals]
    if missing:
        raise ParseError(f"missing metrics: {', '.join(missing)}")
    overflown = [name for name, total in totals.items() if not math.isfinite(total)]
    if overflown:
        raise ParseError(f"{', '.join(overflown)}: the series add up past a float's range")
    return EngineSample(
        time=time,
        generation_tokens_total=totals[GENERATION_TOKENS],
        prompt_tokens_total=totals[PROMPT_TOKENS],
        kv_cache_usage=min(totals[KV_CACHE_USAGE], 1.0),
        requests_waiting=totals[REQUESTS_WAITING],
        requests_running=totals.get(REQUESTS_RUNNING, 0.0),
        capacity_generation=_finite(capacity_generation),
        capacity_prompt=_finite(capacity_prompt),
        ttft_buckets=tuple(sorted(ttft.items())),
        tpot_buckets=tuple(sorted(tpot.items())),
    )


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value > 0 else None


def _require_sane(samples: list[Sample], names: tuple[str, ...]) -> None:
    """ParseError naming the first sample of `names` whose value is NaN, infinite or
    negative."""
    for sample in samples:
        if sample.name in names and not math.isfinite(sample.value):
            raise ParseError(f"{sample.name} is {sample.value} (not a finite number)")
        if sample.name in names and sample.value < 0:
            raise ParseError(f"{sample.name} is {sample.value:g} (below zero)")


def router_demand(samples: list[Sample]) -> RouterDemand:
    """The demand signal out of one router's /metrics; ParseError when a gauge is missing, not
    a finite number or negative."""
    _require_sane(samples, _ROUTER_REQUIRED)
    values = {s.name: s.value for s in samples if s.name in _ROUTER_REQUIRED}
    missing = [n for n in _ROUTER_REQUIRED if n not in values]
    if missing:
        raise ParseError(f"missing metrics: {', '.join(missing)}")
    return RouterDemand(values[ROUTER_QUEUED], values[ROUTER_IN_FLIGHT], values[ROUTER_IDLE])
