"""spec.routing: the router in front of the replicas (spec.auth and spec.networkPolicy are in
kvfleet_operator.access_spec)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvfleet_operator.wire import IMAGE_PATTERN, Model

RoutingStrategy = Literal["prefix", "least-load", "round-robin"]


class RoutingSpec(Model):
    """`kvfleet router` in front of the replicas: prefix- and load-aware routing, retries, and
    requests held while the deployment scales up from zero."""

    enabled: bool = Field(
        default=True,
        description="Render the router (Deployment, Service, PDB, RBAC); status.endpoint.url "
        "then points at it. Without it clients reach the engines through their Service.",
    )
    replicas: int = Field(
        default=2,
        ge=1,
        le=32,
        description="Router pods. Two or more keep the deployment reachable while one is "
        "replaced or its node fails (they spread over nodes; the PodDisruptionBudget keeps all "
        "but one up). A prompt no router has seen goes to the same replica from every router, "
        "so a conversation stays on one replica whichever router its turns reach.",
    )
    strategy: RoutingStrategy = Field(
        default="prefix",
        description="prefix: the replica holding the longest prefix of the prompt, within a "
        "load bound; least-load: the replica with the fewest requests in flight and queued; "
        "round-robin: each in turn.",
    )
    queue_size: int = Field(
        default=256,
        ge=0,
        le=100000,
        description="Requests the router holds while no replica is available (scaling from "
        "zero, all replicas restarting); beyond it, 503 at once.",
    )
    queue_timeout_seconds: int = Field(
        default=300,
        ge=1,
        le=3600,
        description="Longest a request waits for a replica; then 503 with Retry-After. Cover "
        "a replica's start-up (weights loading) when scaling from zero.",
    )
    scale_to_zero_after_seconds: int = Field(
        default=600,
        ge=30,
        le=86400,
        description="With autoscaling.minReplicas 0: scale to zero after the router saw no "
        "request for this long.",
    )
    image: str | None = Field(
        default=None,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description="Router image; defaults to the operator's own ($KVFLEET_ROUTER_IMAGE of "
        "its container; it carries `kvfleet router`).",
    )
