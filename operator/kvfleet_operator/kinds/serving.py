"""spec.engine, spec.sla and spec.rollout: the engine's settings, latency targets, rollouts."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvfleet_operator.kinds.cel import cel
from kvfleet_operator.wire import IMAGE_PATTERN, INT32_MAX, Model

# `kvfleet serve` flags the operator sets itself, and the spec field each comes from: given in
# engine.extraArgs (which come last, so the engine's parser would take them) they would serve
# another model or port than the Service, probes and router use, or bypass the checks and the
# memory plan made for the spec's values (fp8 on a GPU without it, a context that does not fit).
MANAGED_ENGINE_FLAGS = {
    "--model": "model.uri",
    "--served-model-name": "model.servedModelName",
    "--host": "(the operator: every interface)",
    "--port": "(the operator: the engine port the Service and probes use)",
    "--max-model-len": "model.maxModelLen",
    "--block-size": "engine.blockSize",
    "--gpu-memory-utilization": "engine.gpuMemoryUtilization",
    "--kv-cache-blocks": "engine.gpuMemoryUtilization (the memory plan sizes the KV cache)",
    "--dtype": "(the operator: the model's 16-bit weights, as the memory plan counts them)",
    "--device": "(the operator: the GPU of resources.accelerator)",
    "--max-num-seqs": "engine.maxNumSeqs",
    "--max-num-batched-tokens": "engine.maxNumBatchedTokens",
    "--enable-prefix-caching": "engine.enablePrefixCaching",
    "--no-enable-prefix-caching": "engine.enablePrefixCaching",
    "--max-queued-requests": "engine.maxQueuedRequests",
    "--max-queued-tokens": "engine.maxQueuedTokens",
    "--tensor-parallel-size": "parallelism.tensor",
    "--pipeline-parallel-size": "parallelism.pipeline",
    "--nnodes": "parallelism (the operator: nodes per replica)",
    "--node-rank": "parallelism (the operator: each pod's rank)",
    "--master-addr": "parallelism (the operator: the group's leader)",
    "--master-port": "parallelism (the operator)",
    "--quantization": "quantization.weights",
    "--kv-cache-dtype": "quantization.kvCache",
    "--kv-cache-calibration": "quantization.kvCacheCalibration",
    "--ttft-slo-ms": "sla.ttftMs",
    "--tpot-slo-ms": "sla.tpotMs",
    "--drain-timeout": "rollout.drainTimeoutSeconds",
    "--api-key": "auth.apiKeySecretRef (a key in extraArgs would be readable in the pod spec)",
}
# The table as a CEL map literal (JSON's, double-quoted: a field may hold an apostrophe);
# `arg.split('=')[0]` is the flag of `--flag` and of `--flag=value`.
_FLAG_FIELDS = json.dumps(MANAGED_ENGINE_FLAGS)
MANAGED_FLAGS_RULE = f"self.all(arg, !(arg.split('=')[0] in {_FLAG_FIELDS}))"
MANAGED_FLAGS_MESSAGE = (
    "engine.extraArgs: flags the operator sets from the spec are not accepted there; set the "
    "spec field instead (--model: model.uri, --quantization: quantization.weights, "
    "--max-model-len: model.maxModelLen, --tensor-parallel-size: parallelism.tensor, ...)"
)
# What kubectl shows: the first such argument and its field, worded as `_no_managed_flags`.
MANAGED_FLAGS_MESSAGE_EXPRESSION = (
    f"self.map(arg, arg.split('=')[0]).filter(flag, flag in {_FLAG_FIELDS}).map(flag, "
    "'engine.extraArgs: ' + flag + ' is set by the operator from ' + "
    f"{_FLAG_FIELDS}[flag] + '; set that instead')[0]"
)


# The engine's own rule (kvfleet_engine.config.scheduler): every sequence of a step takes at
# least one of its tokens. The defaults stand in for a field left out.
BATCH_RULE = (
    "(has(self.maxNumBatchedTokens) ? self.maxNumBatchedTokens : 8192) >= "
    "(has(self.maxNumSeqs) ? self.maxNumSeqs : 256)"
)
BATCH_MESSAGE = (
    "engine.maxNumBatchedTokens must be >= engine.maxNumSeqs (default 256): every sequence in a "
    "step takes at least one token of the step's budget, and the engine refuses to start otherwise"
)


class EngineSpec(Model):  # defaults: the engine's (tests/engine/test_config_defaults.py)
    model_config = ConfigDict(json_schema_extra=cel((BATCH_RULE, BATCH_MESSAGE)))

    image: str | None = Field(
        default=None,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description="Engine image; defaults to the operator's.",
    )
    block_size: Literal[1, 2, 4, 8, 16, 32, 64, 128, 256] = Field(
        default=16, description="Tokens per KV-cache block: a power of two up to 256."
    )
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
    extra_args: list[
        Annotated[str, Field(max_length=1024, description="One argument, e.g. --seed or 42.")]
    ] = Field(
        default_factory=list,
        max_length=64,
        description="Extra `kvfleet serve` arguments, appended after the generated ones; not "
        "the flags the operator sets from other fields.",
        json_schema_extra=cel(
            (MANAGED_FLAGS_RULE, MANAGED_FLAGS_MESSAGE, MANAGED_FLAGS_MESSAGE_EXPRESSION)
        ),
    )

    @field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, args: list[str]) -> list[str]:
        # The CEL rule above, for objects stored before it existed.
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_ENGINE_FLAGS:
                raise ValueError(
                    f"engine.extraArgs: {flag} is set by the operator from "
                    f"{MANAGED_ENGINE_FLAGS[flag]}; set that instead"
                )
        return args

    @model_validator(mode="after")
    def _budget_holds_the_batch(self) -> EngineSpec:
        # The CEL rule above, for objects stored before it existed.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"engine.maxNumBatchedTokens ({self.max_num_batched_tokens}) must be >= "
                f"engine.maxNumSeqs ({self.max_num_seqs}): every sequence in a step takes at "
                "least one token of the step's budget, and the engine refuses to start otherwise"
            )
        return self


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


# Rendered into int32 fields (progressDeadlineSeconds, the startup probe's failureThreshold).
STARTUP_TIMEOUT_MAX_SECONDS = 7 * 24 * 3600


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

    max_surge: int = Field(
        default=0, ge=0, le=INT32_MAX, description="Extra pods during a rollout."
    )
    max_unavailable: int = Field(
        default=1, ge=0, le=INT32_MAX, description="Pods that may be down in a rollout."
    )
    drain_timeout_seconds: int = Field(
        default=30, ge=0, le=3600, description="Time a stopping engine finishes in-flight requests."
    )
    startup_timeout_seconds: int | None = Field(
        default=None,
        ge=30,
        le=STARTUP_TIMEOUT_MAX_SECONDS,
        description="Time allowed for loading weights (at most a week); defaults to 120 s + "
        "10 s per GiB.",
    )

    @model_validator(mode="after")
    def _rollout_can_move(self) -> RolloutSpec:
        # The CEL rule above, for objects stored before it existed.
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError(ROLLOUT_MESSAGE)
        return self
