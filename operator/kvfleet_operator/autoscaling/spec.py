"""`spec.autoscaling` of an InferenceDeployment: the typed model the CRD schema is generated from.

Every field carries a description (it becomes the CRD's OpenAPI description); only optional leaf
fields have defaults, so the API server never writes objects into a user's spec. Cross-field
rules raise `ValueError` with a message naming the field; the operator mirrors the simple ones as
CEL rules in the CRD.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvfleet_operator.wire import INT32_MAX, Model, to_wire_name

Controller = Literal["Builtin", "HPA", "KEDA"]
# The smallest per-replica target: HPA and KEDA carry targets as milli-unit quantities, so a
# smaller one was rendered as 0 ("0m"), which the API server refuses.
TARGET_RESOLUTION = 0.001
MetricsSource = Literal["Direct", "Prometheus"]


class PrometheusSource(Model):
    """Where the Builtin controller (source: Prometheus) and KEDA triggers read engine metrics."""

    url: str = Field(
        pattern=r"^https?://[^\s]+$",
        description="Base URL of the Prometheus HTTP API, e.g. http://prometheus.monitoring:9090. "
        "Series must carry the standard `namespace` and `pod` target labels.",
    )


class TokenRateTarget(Model):
    """Target token rate per replica: an absolute number, or a fraction of measured capacity."""

    tokens_per_second: float | None = Field(
        default=None,
        ge=TARGET_RESOLUTION,
        le=1e9,
        description="Absolute target: tokens per second per ready replica.",
    )
    capacity_fraction: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Relative target: fraction (0-1] of the per-replica capacity the engine "
        "measured itself at start-up (kvfleet_engine_capacity_tokens_per_second).",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> TokenRateTarget:
        if (self.tokens_per_second is None) == (self.capacity_fraction is None):
            raise ValueError("set exactly one of tokensPerSecond or capacityFraction")
        return self


class LatencyTarget(Model):
    """A latency percentile that must stay under a threshold; over it, the fleet grows."""

    quantile: float = Field(
        default=0.9,
        gt=0,
        lt=1,
        description="Quantile of the latency histogram, e.g. 0.9 for p90.",
    )
    seconds: float = Field(
        gt=0,
        le=3600,
        description="Target for that quantile in seconds (take it from spec.sla).",
    )


class AutoscalingTargets(Model):
    """Per-signal targets. Desired replicas is the maximum over the signals that are set."""

    generation_token_rate: TokenRateTarget | None = Field(
        default=None,
        description="Generated (output) tokens per second per replica "
        "(rate of kvfleet_generation_tokens_total).",
    )
    prompt_token_rate: TokenRateTarget | None = Field(
        default=None,
        description="Prompt (input) tokens per second per replica "
        "(rate of kvfleet_prompt_tokens_total).",
    )
    kv_cache_utilization: float | None = Field(
        default=None,
        ge=TARGET_RESOLUTION,
        le=1,
        description="Target average KV-cache utilization (0-1] across replicas "
        "(kvfleet_kv_cache_usage_ratio).",
    )
    waiting_requests_per_replica: float | None = Field(
        default=None,
        ge=TARGET_RESOLUTION,
        le=1e6,
        description="Target number of queued requests per replica (kvfleet_requests_waiting).",
    )
    ttft: LatencyTarget | None = Field(
        default=None,
        description="Time-to-first-token percentile target "
        "(kvfleet_time_to_first_token_seconds); Builtin and KEDA controllers only.",
    )
    tpot: LatencyTarget | None = Field(
        default=None,
        description="Time-per-output-token percentile target "
        "(kvfleet_inter_token_latency_seconds); Builtin and KEDA controllers only.",
    )

    def names(self) -> list[str]:
        """The signals that are set, by field name."""
        return [name for name in type(self).model_fields if getattr(self, name) is not None]


class ScaleUpRules(Model):
    """How fast the fleet may grow."""

    stabilization_window_seconds: int = Field(
        default=0,
        ge=0,
        le=3600,
        description="Scale up only to the lowest recommendation seen in this window "
        "(0: act at once).",
    )
    max_replicas_per_period: int = Field(
        default=4,
        ge=1,
        le=INT32_MAX,
        description="At most this many replicas added per period (or maxPercentPerPeriod, "
        "whichever allows more).",
    )
    max_percent_per_period: int = Field(
        default=100,
        ge=0,
        le=INT32_MAX,
        description="At most this percentage of the current replicas added per period.",
    )
    period_seconds: int = Field(
        default=15, ge=1, le=1800, description="Length of the rate-limit period in seconds."
    )


class ScaleDownRules(Model):
    """How fast the fleet may shrink."""

    stabilization_window_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="Scale down only to the highest recommendation seen in this window, so a "
        "vanished spike does not shrink the fleet at once.",
    )
    max_replicas_per_period: int = Field(
        default=1,
        ge=1,
        le=INT32_MAX,
        description="At most this many replicas removed per period (or maxPercentPerPeriod, "
        "whichever allows more).",
    )
    max_percent_per_period: int = Field(
        default=0,
        ge=0,
        le=100,
        description="At most this percentage of the current replicas removed per period.",
    )
    period_seconds: int = Field(
        default=60, ge=1, le=1800, description="Length of the rate-limit period in seconds."
    )
    drain_timeout_seconds: int = Field(
        default=60,
        ge=0,
        le=86400,
        description="Before removing a replica, wait up to this long for the replica with the "
        "least work in flight to become idle.",
    )


class AutoscalingBehavior(Model):
    """Windows, tolerance, stabilization and rate limits (Knative KPA + HPA v2 semantics)."""

    sync_period_seconds: int = Field(
        default=5,
        ge=1,
        le=300,
        description="How often metrics are read and a decision is made.",
    )
    stable_window_seconds: int = Field(
        default=60,
        ge=2,
        le=3600,
        description="Averaging window for the stable decision.",
    )
    panic_window_seconds: int = Field(
        default=10,
        ge=2,
        le=3600,
        description="Short window for the panic decision; must not exceed stableWindowSeconds.",
    )
    panic_threshold: float = Field(
        default=2.0,
        gt=1,
        description="Enter panic mode when the panic-window desired replicas reach this multiple "
        "of the ready replicas. In panic the fleet only grows.",
    )
    tolerance: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="Ignore a signal whose value is within this fraction of its target.",
    )
    warmup_seconds: int = Field(
        default=60,
        ge=0,
        description="Pods younger than this (since they became ready) are left out of the "
        "averages.",
    )
    scale_up: ScaleUpRules = Field(
        default_factory=ScaleUpRules, description="Scale-up stabilization and rate limit."
    )
    scale_down: ScaleDownRules = Field(
        default_factory=ScaleDownRules, description="Scale-down stabilization and rate limit."
    )

    @model_validator(mode="after")
    def _windows(self) -> AutoscalingBehavior:
        if self.panic_window_seconds > self.stable_window_seconds:
            raise ValueError(
                f"behavior.panicWindowSeconds ({self.panic_window_seconds}) must be <= "
                f"behavior.stableWindowSeconds ({self.stable_window_seconds})"
            )
        if self.panic_window_seconds < 2 * self.sync_period_seconds:
            raise ValueError(
                f"behavior.panicWindowSeconds ({self.panic_window_seconds}) must be at least "
                f"twice behavior.syncPeriodSeconds ({self.sync_period_seconds}) so a token rate "
                "can be measured inside it"
            )
        return self


class AutoscalingSpec(Model):
    """Scale the InferenceDeployment's replicas on what its engines report."""

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=INT32_MAX,
        description="Fewest replicas. 0 scales to zero after routing.scaleToZeroAfterSeconds "
        "without requests, and back to one when a request waits in the router; it needs "
        "routing.enabled and controller Builtin.",
    )
    max_replicas: int = Field(ge=1, le=INT32_MAX, description="Most replicas.")
    controller: Controller = Field(
        default="Builtin",
        description="Who scales: Builtin (the operator itself), HPA (an autoscaling/v2 "
        "HorizontalPodAutoscaler on Pods metrics from a custom-metrics adapter) or KEDA "
        "(a ScaledObject with Prometheus triggers). With HPA or KEDA the operator renders "
        "that object and leaves replicas alone.",
    )
    source: MetricsSource = Field(
        default="Direct",
        description="Where the Builtin controller reads metrics: Direct (scrape each ready "
        "pod's /metrics) or Prometheus (query prometheus.url).",
    )
    prometheus: PrometheusSource | None = Field(
        default=None,
        description="Prometheus to query; required with source: Prometheus or controller: KEDA.",
    )
    targets: AutoscalingTargets = Field(
        description="Per-replica targets; at least one. Desired replicas is the maximum over "
        "the signals."
    )
    behavior: AutoscalingBehavior = Field(
        default_factory=AutoscalingBehavior,
        description="Windows, tolerance, stabilization, rate limits and warm-up.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas ({self.min_replicas}) must be <= "
                f"autoscaling.maxReplicas ({self.max_replicas})"
            )
        signals = self.targets.names()
        if not signals:
            raise ValueError(
                "autoscaling.targets: set at least one of generationTokenRate, promptTokenRate, "
                "kvCacheUtilization, waitingRequestsPerReplica, ttft, tpot"
            )
        prompt_rate = self.targets.prompt_token_rate
        if prompt_rate is not None and prompt_rate.capacity_fraction is not None:
            raise ValueError(
                "autoscaling.targets.promptTokenRate.capacityFraction is not supported: the engine "
                "measures generation capacity only; use promptTokenRate.tokensPerSecond"
            )
        if self.min_replicas == 0 and self.controller != "Builtin":
            raise ValueError(
                f"autoscaling.minReplicas: 0 needs controller Builtin (got {self.controller}): "
                "the router's demand signal, which scales from zero, feeds the built-in "
                "autoscaler only"
            )
        needs_prometheus = self.source == "Prometheus" or self.controller == "KEDA"
        if needs_prometheus and self.prometheus is None:
            raise ValueError(
                "autoscaling.prometheus.url is required with source: Prometheus or controller: KEDA"
            )
        if not needs_prometheus and self.prometheus is not None:
            raise ValueError(
                "autoscaling.prometheus is only used with source: Prometheus or controller: KEDA"
            )
        if self.controller == "HPA":
            if self.source == "Prometheus":
                raise ValueError(
                    "autoscaling.source: Prometheus applies to controller: Builtin; an HPA reads "
                    "the custom metrics API"
                )
            unsupported: list[str] = [name for name in ("ttft", "tpot") if name in signals]
            for name in ("generation_token_rate", "prompt_token_rate"):
                rate = getattr(self.targets, name)
                if rate is not None and rate.capacity_fraction is not None:
                    unsupported.append(f"{name}.capacity_fraction")
            if unsupported:
                raise ValueError(
                    "autoscaling.controller: HPA cannot express targets "
                    f"{', '.join(to_camel_path(n) for n in unsupported)}; use Builtin or KEDA"
                )
        return self


def to_camel_path(field_path: str) -> str:
    """`generation_token_rate.capacity_fraction` -> `generationTokenRate.capacityFraction`."""
    return ".".join(to_wire_name(part) for part in field_path.split("."))
