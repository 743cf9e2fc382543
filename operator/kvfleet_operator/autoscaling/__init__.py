"""Autoscaling of InferenceDeployments on the token rate, KV-cache utilization and queue depth
their engines report: the spec model, the pure decision function, the metrics readers and the
loop that writes the child Deployment's replicas."""

from kvfleet_operator.autoscaling.spec import AutoscalingSpec

__all__ = ["AutoscalingSpec"]
