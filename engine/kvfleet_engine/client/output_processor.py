"""`OutputProcessor`: the core's per-step token ids in, cumulative outputs with text out.

Runs in the API process. Each request keeps its tokens, logprobs and an incremental
detokenizer here; a step record adds the new tokens, the detokenizer turns them into text and
looks for stop strings. A stop string found ends the request on this side at once; the caller
aborts it in the core (which may have run a step or two further: those tokens are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfleet_engine.core.records import StepOutputs
from kvfleet_engine.detokenizer import IncrementalDetokenizer
from kvfleet_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvfleet_engine.sampling import SamplingParams


@dataclass(eq=False)
class _RequestState:
    request_id: str
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    # None unless the request asked for logprobs.
    logprobs: list[dict[int, float]] | None
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        self.requests[request_id] = _RequestState(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
            metrics=RequestMetrics(arrival_time=arrival_time),
            logprobs=[] if params.logprobs is not None else None,
        )

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, step: StepOutputs) -> tuple[list[RequestOutput], list[str]]:
        """(an output per known request that got tokens, ids a stop string ended here: abort
        them in the core). Finished requests are forgotten."""
        outputs = []
        stopped = []
        requests = self.requests
        timestamp = step.timestamp
        for request_id, new_token_ids in zip(step.request_ids, step.new_token_ids, strict=True):
            state = requests.get(request_id)
            if state is None:
                continue  # aborted, or stopped here while the core ran on
            state.token_ids += new_token_ids
            metrics = state.metrics
            started = step.started.get(request_id)
            if started is not None:
                state.num_cached_tokens = started.num_cached_tokens
                metrics.first_scheduled_time = started.first_scheduled_time
                metrics.first_token_time = timestamp
            metrics.last_token_time = timestamp
            if state.logprobs is not None:
                for token_id, logprobs in zip(
                    new_token_ids, step.new_logprobs.get(request_id, ()), strict=False
                ):
                    state.logprobs.append(logprobs)
                    state.cumulative_logprob += logprobs[token_id]
            done = step.finished.get(request_id)
            finish_reason = stop_reason = None
            if done is not None:
                finish_reason, stop_reason = done.finish_reason, done.stop_reason
                metrics.finished_time = done.finished_time
            stop = state.detokenizer.update(new_token_ids, final=done is not None)
            if stop is not None:  # the stop string wins over a length limit on the same token
                finish_reason, stop_reason = "stop", stop
                if done is None:
                    stopped.append(request_id)
                    metrics.finished_time = timestamp
            if finish_reason is not None:
                del requests[request_id]
            outputs.append(_output(state, finish_reason, stop_reason))
        return outputs, stopped


def _output(
    state: _RequestState, finish_reason: str | None, stop_reason: int | str | None
) -> RequestOutput:
    finished = finish_reason is not None
    logprobs = state.logprobs
    completion = CompletionOutput(
        index=0,
        text=state.detokenizer.output_text(finished),
        token_ids=list(state.token_ids),
        cumulative_logprob=state.cumulative_logprob if logprobs is not None else None,
        logprobs=list(logprobs) if logprobs is not None else None,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )
    return RequestOutput(
        request_id=state.request_id,
        prompt=None,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[completion],
        finished=finished,
        num_cached_tokens=state.num_cached_tokens,
        metrics=state.metrics,
    )
