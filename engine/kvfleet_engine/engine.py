"""LLMEngine: the engine core plus text, in one process (the offline `LLM` drives it).

Not thread-safe: one thread drives it. Each step() launches step n+1 before it returns step n's
outputs, so the device has the next step queued while the host turns step n's tokens into
outputs; the first call launches two steps, so the k-th call returns the k-th step's tokens.
With async scheduling (the default) step n+1 is also scheduled and launched before step n's
tokens reach the host (its decodes take them on the device); without it, or while a request
with penalties runs (they count output tokens when the step is built), step n is collected
first and the device idles meanwhile. The server does not use it: there the engine core runs
in its own process and the API process turns tokens into text (`async_engine`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.engine_core import EngineCore
from kvfleet_engine.detokenizer import IncrementalDetokenizer
from kvfleet_engine.model_runner import ModelRunner
from kvfleet_engine.outputs import CompletionOutput, RequestOutput
from kvfleet_engine.request import Request, RequestStatus
from kvfleet_engine.sampling import SamplingParams
from kvfleet_engine.tokenizer import load_tokenizer

__all__ = ["LLMEngine", "load_tokenizer"]

log = logging.getLogger(__name__)


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig, tokenizer: Any, runner: ModelRunner) -> None:
        super().__init__(config, runner)
        self.tokenizer = tokenizer
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # True: step() returns an output for every request that got a token, with the text so
        # far (streaming consumers). False: step() returns finished requests only, and the text
        # of one without stop strings is decoded once, at the end (LLM.generate sets it while
        # it runs).
        self.stream_outputs = True
        self.prompts: dict[str, str | None] = {}

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        tokenizer = load_tokenizer(config.model)
        return cls(config, tokenizer, ModelRunner(config))

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        *,
        prompt: str | None = None,
    ) -> Request:
        """Queue a request. Raises ValueError naming the problem for bad input."""
        request = super().add_request(request_id, prompt_token_ids, params, priority, arrival_time)
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params
        )
        self.prompts[request_id] = prompt
        return request

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Drop requests (running or waiting) and free their blocks; they produce no output."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        super().abort_request(ids)
        for request_id in ids:
            self.detokenizers.pop(request_id, None)
            self.prompts.pop(request_id, None)

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance every running request by one step. Returns the requests that got tokens
        (streaming) or finished; with async scheduling, those of the step launched last time."""
        return self._outputs(self.advance())

    def _outputs(self, progressed: list[Request]) -> list[RequestOutput]:
        if self.stream_outputs:
            return [self._output(request) for request in progressed]
        outputs = []
        for request in progressed:
            if request.params.stop:  # stop strings are looked for token by token
                self._detokenize(request)
            if request.is_finished:
                outputs.append(self._output(request))
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        detokenizer = self.detokenizers[request.request_id]
        if self.stream_outputs:
            self._detokenize(request)
        elif not request.params.stop:
            detokenizer.decode_all(request.output_token_ids)
        finished = request.is_finished
        if finished:
            del self.detokenizers[request.request_id]
            self._added_time.pop(request.request_id, None)  # step_outputs() is not used here
        wants_logprobs = request.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=detokenizer.output_text(finished),
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if wants_logprobs else None,
            logprobs=list(request.output_logprobs) if wants_logprobs else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )
        prompt = (
            self.prompts.pop(request.request_id) if finished else self.prompts[request.request_id]
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics=request.metrics,
        )

    def _detokenize(self, request: Request) -> None:
        """Add the newest token to the request's text; a stop string found there ends it."""
        detokenizer = self.detokenizers[request.request_id]
        stop = detokenizer.update(request.output_token_ids[-1:], final=request.is_finished)
        if stop is not None:
            if request.is_finished:  # the same token also hit a length limit: the stop wins
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            else:
                self.scheduler.finish([request.request_id], RequestStatus.FINISHED_STOPPED, stop)
