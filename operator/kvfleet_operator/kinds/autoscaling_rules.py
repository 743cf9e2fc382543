"""The CEL rules on spec.autoscaling, attached to the whole spec since they read across its
fields (the fields and their pydantic validators are kvfleet_operator.autoscaling.spec's)."""

from __future__ import annotations


def _one_rate_target(name: str) -> tuple[str, str]:
    rate = f"self.autoscaling.targets.{name}"
    return (
        f"!has(self.autoscaling) || !has({rate}) || "
        f"has({rate}.tokensPerSecond) != has({rate}.capacityFraction)",
        f"autoscaling.targets.{name}: set exactly one of tokensPerSecond or capacityFraction",
    )


# CEL mirrors of AutoscalingSpec's own validators, so kubectl rejects what the operator would.
AUTOSCALING_RULES = (
    (
        "!has(self.autoscaling) || has(self.autoscaling.targets.generationTokenRate) || "
        "has(self.autoscaling.targets.promptTokenRate) || "
        "has(self.autoscaling.targets.kvCacheUtilization) || "
        "has(self.autoscaling.targets.waitingRequestsPerReplica) || "
        "has(self.autoscaling.targets.ttft) || has(self.autoscaling.targets.tpot)",
        "autoscaling.targets: set at least one of generationTokenRate, promptTokenRate, "
        "kvCacheUtilization, waitingRequestsPerReplica, ttft, tpot",
    ),
    (
        "!has(self.autoscaling) || !has(self.autoscaling.behavior) || "
        "self.autoscaling.behavior.panicWindowSeconds <= "
        "self.autoscaling.behavior.stableWindowSeconds",
        "autoscaling.behavior.panicWindowSeconds must be <= stableWindowSeconds",
    ),
    (
        "!has(self.autoscaling) || !has(self.autoscaling.behavior) || "
        "self.autoscaling.behavior.panicWindowSeconds >= "
        "2 * self.autoscaling.behavior.syncPeriodSeconds",
        "autoscaling.behavior.panicWindowSeconds must be at least twice syncPeriodSeconds so a "
        "token rate can be measured inside it",
    ),
    _one_rate_target("generationTokenRate"),
    (
        "!has(self.autoscaling) || !has(self.autoscaling.targets.promptTokenRate) || "
        "(has(self.autoscaling.targets.promptTokenRate.tokensPerSecond) && "
        "!has(self.autoscaling.targets.promptTokenRate.capacityFraction))",
        "autoscaling.targets.promptTokenRate: set tokensPerSecond (capacityFraction is not "
        "supported: the engine measures generation capacity only)",
    ),
    (
        "!has(self.autoscaling) || self.autoscaling.minReplicas > 0 || "
        "self.autoscaling.controller == 'Builtin'",
        "autoscaling.minReplicas: 0 needs controller Builtin: the router's demand signal, which "
        "scales from zero, feeds the built-in autoscaler only",
    ),
    (
        "!has(self.autoscaling) || has(self.autoscaling.prometheus) == "
        "(self.autoscaling.source == 'Prometheus' || self.autoscaling.controller == 'KEDA')",
        "autoscaling.prometheus.url is required with source: Prometheus or controller: KEDA, and "
        "used only with them",
    ),
    (
        "!has(self.autoscaling) || self.autoscaling.controller != 'HPA' || "
        "self.autoscaling.source != 'Prometheus'",
        "autoscaling.source: Prometheus applies to controller: Builtin; an HPA reads the custom "
        "metrics API",
    ),
    (
        "!has(self.autoscaling) || self.autoscaling.controller != 'HPA' || "
        "!(has(self.autoscaling.targets.ttft) || has(self.autoscaling.targets.tpot) || "
        "(has(self.autoscaling.targets.generationTokenRate) && "
        "has(self.autoscaling.targets.generationTokenRate.capacityFraction)))",
        "autoscaling.controller: HPA cannot express targets ttft, tpot or "
        "generationTokenRate.capacityFraction; use Builtin or KEDA",
    ),
)
