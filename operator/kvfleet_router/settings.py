"""The router's settings: one frozen record, read once at the edge (`kvfleet router` flags)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

StrategyName = Literal["prefix", "least-load", "round-robin"]
STRATEGY_NAMES: tuple[StrategyName, ...] = ("prefix", "least-load", "round-robin")
# A bearer key a client can send, as the engine's --api-key takes it: printable ASCII without a
# space at either end (a header cannot carry a newline, and servers strip the spaces).
SENDABLE_KEY = re.compile(r"[!-~]([ -~]*[!-~])?")
ENGINE_PORT = 8000  # the engine's container port (the `http` port of its Service)


@dataclass(frozen=True)
class RouterSettings:
    """Everything `kvfleet router` is told; each component reads only its own fields."""

    # Replicas: either the engine Service of an InferenceDeployment (its EndpointSlices)...
    deployment: str | None = None  # InferenceDeployment name = its engine Service's name
    namespace: str | None = None  # its namespace
    discovery: str = "endpointslices"  # or "pods": what lists the ready replicas
    # ...or fixed engine base URLs (http://host:port, no path), for local use.
    backends: tuple[str, ...] = ()
    # Model names clients may ask for; empty: learned from the replicas' metrics.
    served_model_names: tuple[str, ...] = ()
    strategy: StrategyName = "prefix"
    host: str = "0.0.0.0"  # listen address
    port: int = ENGINE_PORT  # listen port
    queue_size: int = 256  # requests that may wait for a replica; beyond it, 503 at once
    queue_timeout_s: float = 300.0  # longest wait for a replica; then 503 with Retry-After
    scrape_interval_s: float = 0.1  # each replica's /metrics read this often (10 Hz)
    max_attempts: int = 3  # replicas tried per request: 429 (busy), lost or timed out
    connect_timeout_s: float = 2.0  # TCP connect to a replica
    # Request sent -> the replica's answer headers; then the attempt failed (next replica). An
    # engine sends a stream's headers when it takes the request, a JSON answer's once it is
    # complete: this bounds a non-streamed generation too.
    upstream_first_byte_timeout_s: float = 300.0
    # Longest wait for the next bytes of an answer's body; a stream then ends with an error.
    # The longest gap in an engine's stream: queue wait plus prefill before the first token.
    upstream_idle_timeout_s: float = 120.0
    # A connection's request line and headers must be complete this long after it opens, or
    # after its next request's first byte; else it is closed (a stalled client, a slowloris).
    header_timeout_s: float = 10.0
    # The longest wait for a request body's next bytes; then a 408 and the connection closed
    # (a client that stalled after its head). nginx's client_body_timeout, as `kvfleet serve`.
    body_timeout_s: float = 60.0
    # An idle client connection is closed after this long: above the idle timeout of the
    # proxies in front (60 s for AWS ALB and nginx), as `kvfleet serve --keep-alive-timeout`,
    # or one may reuse a connection as it closes; aiohttp's own default is an hour.
    keep_alive_timeout_s: float = 75.0
    block_chars: int = 64  # characters per prefix block (about 16 tokens of English text)
    load_factor: float = 1.25  # bounded load: no replica above this x the mean load (prefix)
    # Larger request bodies get a 413 from the router; the engine's own default limit (a larger
    # body could only get the engine's 413, after the router had parsed and hashed it).
    max_request_body_bytes: int = 4 * 1024 * 1024
    # Clients must send it, and the router sends it to the engines; None: no authentication.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.deployment is not None and self.backends:
            raise ValueError("set either deployment (with namespace) or backends, not both")
        if self.deployment is None and not self.backends:
            raise ValueError("set deployment (with namespace) or backends: no replicas to route to")
        if self.deployment is not None and not self.namespace:
            raise ValueError("namespace: required with deployment")
        for url in self.backends:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"backends: {url!r} is not an http://host:port URL")
        if self.discovery not in ("endpointslices", "pods"):
            raise ValueError(f"discovery: must be endpointslices or pods, got {self.discovery!r}")
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(
                f"strategy: must be one of {', '.join(STRATEGY_NAMES)}, got {self.strategy!r}"
            )
        checks = (
            ("port", 1 <= self.port <= 65535, "1..65535"),
            ("queue_size", self.queue_size >= 0, ">= 0"),
            ("queue_timeout_s", self.queue_timeout_s > 0, "> 0"),
            ("scrape_interval_s", 0 < self.scrape_interval_s <= 0.1, "in (0, 0.1] (>= 10 Hz)"),
            ("max_attempts", self.max_attempts >= 1, ">= 1"),
            ("connect_timeout_s", self.connect_timeout_s > 0, "> 0"),
            *(
                (name, 0 < getattr(self, name) < math.inf, "a positive number of seconds")
                for name in (
                    "upstream_first_byte_timeout_s",
                    "upstream_idle_timeout_s",
                    "header_timeout_s",
                    "keep_alive_timeout_s",
                )
            ),
            # inf: no body timeout, as the engine's `--body-timeout inf` (which the operator
            # passes on from engine.extraArgs)
            ("body_timeout_s", self.body_timeout_s > 0, "a positive number of seconds or inf"),
            ("block_chars", self.block_chars >= 1, ">= 1"),
            ("load_factor", self.load_factor > 1, "> 1"),
            ("max_request_body_bytes", self.max_request_body_bytes >= 1, ">= 1"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name}: must be {allowed}, got {getattr(self, name)!r}")
        if self.api_key is not None and not SENDABLE_KEY.fullmatch(self.api_key):
            raise ValueError(
                "api_key: must be a non-empty key of printable ASCII characters, not starting or "
                "ending with a space (unset: no authentication)"
            )

    @property
    def retry_after_s(self) -> int:
        """Retry-After of a 503 when no replica came in time: a few seconds, since the replicas
        are still starting."""
        return max(1, min(30, round(self.queue_timeout_s / 10)))
