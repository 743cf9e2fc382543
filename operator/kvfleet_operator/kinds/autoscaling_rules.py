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
    _one_rate_target("generationTokenRate"),
    (
        "!has(self.autoscaling) || !has(self.autoscaling.targets.promptTokenRate) || "
        "(has(self.autoscaling.targets.promptTokenRate.tokensPerSecond) && "
        "!has(self.autoscaling.targets.promptTokenRate.capacityFraction))",
        "autoscaling.targets.promptTokenRate: set tokensPerSecond (capacityFraction is not "
        "supported: the engine measures generation capacity only)",
    ),
)
