"""Server settings and the server's lifecycle state: starting -> ready -> draining."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvfleet_engine.async_engine import AsyncEngine
from kvfleet_engine.metrics import EngineMetrics
from kvfleet_engine.server.admission import AdmissionConfig, AdmissionPolicy, QueueSnapshot
from kvfleet_engine.server.body_limit import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BODY_BYTES
from kvfleet_engine.server.errors import APIError


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str  # the `model` clients must name
    max_model_len: int  # prompt + generated tokens per request
    vocab_size: int  # token ids in prompts must be below this
    max_num_batched_tokens: int  # the scheduler's per-step token budget (SLA mode lowers it)
    max_num_seqs: int  # most requests in one step's batch
    admission: AdmissionConfig  # queue bounds and SLA targets
    drain_timeout_s: float  # SIGTERM: how long in-flight requests may take to finish
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies: 413
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a body's next bytes within it, or 408
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    log_requests: bool = False  # one JSON line per request: ids, status, tokens, timings


class ServerState:
    """What every route consults: readiness, draining, admission. Lives on the event loop."""

    def __init__(self, settings: ServerSettings, engine: AsyncEngine, metrics: EngineMetrics):
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.policy = AdmissionPolicy(settings.admission, settings.max_num_batched_tokens)
        self.warmed_up = False  # the start-up self-benchmark ran
        self.draining = False  # SIGTERM received: finish in-flight work, admit nothing new
        self.startup_error: str | None = None  # why warm-up failed (then never ready)
        self.started_at = time.time()

    @property
    def ready(self) -> bool:
        return self.warmed_up and not self.draining and self.engine.is_alive

    def check_accepting(self) -> None:
        """503 unless the server takes new work now."""
        if self.draining:
            self.metrics.observe_rejected("draining")
            raise APIError(
                503,
                "server is shutting down; send the request to another replica",
                type_="service_unavailable",
                headers={"Retry-After": "1", "Connection": "close"},
            )
        if not self.engine.is_alive:
            raise APIError(503, "engine is not running", type_="service_unavailable")
        if not self.warmed_up:
            raise APIError(
                503,
                "server is starting (loading weights, warming up); retry shortly",
                type_="service_unavailable",
                headers={"Retry-After": "1"},
            )

    def admit(self, num_prompt_tokens: int, num_requests: int) -> None:
        """429 with Retry-After when the waiting queue or the TTFT target has no room."""
        engine = self.engine
        queue = QueueSnapshot(
            engine.num_queued_requests, engine.num_queued_tokens, engine.num_running
        )
        rejection = self.policy.check(queue, num_prompt_tokens, num_requests)
        if rejection is None:
            return
        self.metrics.observe_rejected(rejection.reason)
        raise APIError(
            429,
            rejection.message,
            param=rejection.param,
            type_="rate_limit_error",
            code=rejection.reason,
            headers={"Retry-After": str(rejection.retry_after_s)},
        )
