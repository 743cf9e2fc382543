"""spec.engine, spec.sla and spec.rollout: the engine's settings, latency targets, rollouts."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from kvfleet_operator.kinds.cel import cel
from kvfleet_operator.wire import Model


class EngineSpec(Model):  # defaults: the engine's (tests/engine/test_config_defaults.py)
    image: str | None = Field(
        default=None, max_length=512, description="Engine image; defaults to the operator's."
    )
    block_size: int = Field(default=16, ge=1, le=256, description="Tokens per KV-cache block.")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of GPU memory the engine may use."
    )
    max_num_seqs: int = Field(default=256, ge=1, description="Sequences batched per step.")
    max_num_batched_tokens: int = Field(default=8192, ge=1, description="Token budget per step.")
    enable_prefix_caching: bool = Field(default=True, description="Reuse cached prompt prefixes.")
    max_queued_requests: int | None = Field(
        default=None, ge=1, description="Requests that may wait; beyond it the engine answers 429."
    )
    max_queued_tokens: int | None = Field(
        default=None, ge=1, description="Prompt tokens that may wait; beyond it, 429."
    )
    extra_args: list[Annotated[str, Field(description="One argument, e.g. --seed or 42.")]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra `kvfleet serve` arguments, appended after the generated ones.",
    )


class SLASpec(Model):
    ttft_ms: int | None = Field(
        default=None,
        ge=1,
        description="Time-to-first-token target (ms): the engine refuses (429) requests it "
        "estimates would miss it.",
    )
    tpot_ms: int | None = Field(
        default=None,
        ge=1,
        description="Time-per-output-token target (ms): the engine caps each step's token "
        "budget to hold it.",
    )
    concurrent_sequences: int = Field(
        default=1,
        ge=1,
        description="Full-length sequences one replica must hold in KV cache at once; sizes the "
        "memory plan.",
    )


ROLLOUT_MESSAGE = (
    "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: a rollout could then neither "
    "add a pod nor take one down"
)


class RolloutSpec(Model):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "(has(self.maxSurge) && self.maxSurge > 0) || !has(self.maxUnavailable) || "
                "self.maxUnavailable > 0",
                ROLLOUT_MESSAGE,
            )
        )
    )

    max_surge: int = Field(default=0, ge=0, description="Extra pods during a rollout.")
    max_unavailable: int = Field(default=1, ge=0, description="Pods that may be down in a rollout.")
    drain_timeout_seconds: int = Field(
        default=30, ge=0, le=3600, description="Time a stopping engine finishes in-flight requests."
    )
    startup_timeout_seconds: int | None = Field(
        default=None,
        ge=30,
        description="Time allowed for loading weights; defaults to 120 s + 10 s per GiB.",
    )

    @model_validator(mode="after")
    def _rollout_can_move(self) -> RolloutSpec:
        # The CEL rule above, for objects stored before it existed.
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError(ROLLOUT_MESSAGE)
        return self
