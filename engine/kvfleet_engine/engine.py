"""LLMEngine: the step loop (schedule -> launch -> collect -> update). Not thread-safe: one
thread drives it (the server's async front does so from a single task).

Each step() launches step n+1 before it returns step n's outputs, so the device has the next step
queued while the host turns step n's tokens into outputs; the first call launches two steps, so
the k-th call returns the k-th step's tokens. With async scheduling (the default) step n+1 is
also scheduled and launched before step n's tokens reach the host (its decodes take them on the
device); without it, or while a request with penalties runs (they count output tokens when the
step is built), step n is collected first and the device idles meanwhile."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from kvfleet_engine.config import EngineConfig, ModelConfig
from kvfleet_engine.detokenizer import IncrementalDetokenizer
from kvfleet_engine.kv_cache import KVCacheManager
from kvfleet_engine.model_runner import LaunchedStep, ModelRunner
from kvfleet_engine.outputs import CompletionOutput, RequestOutput, SchedulerStats
from kvfleet_engine.request import Request, RequestStatus
from kvfleet_engine.sampling import SamplingParams
from kvfleet_engine.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger(__name__)


def load_tokenizer(model: ModelConfig) -> Any:
    if model.format == "gguf":
        from kvfleet_engine.loaders.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(model.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.path)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any, runner: ModelRunner) -> None:
        self.config = config
        self.model_config: ModelConfig = config.model
        self.tokenizer = tokenizer
        self.model_runner = runner
        self.kv_cache = KVCacheManager(
            runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, config.model.max_model_len)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # True: step() returns an output for every request that got a token, with the text so
        # far (streaming consumers: the server). False: step() returns finished requests only,
        # and the text of one without stop strings is decoded once, at the end (LLM.generate
        # sets it while it runs).
        self.stream_outputs = True
        self.prompts: dict[str, str | None] = {}
        # The step launched but not collected yet (async scheduling).
        self.in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None

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
    ) -> None:
        """Queue a request. Raises ValueError naming the problem for bad input."""
        self._validate(request_id, prompt_token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.model_config.eos_token_ids,
            priority=priority,
            arrival_time=time.time() if arrival_time is None else arrival_time,
        )
        self.scheduler.add(request)
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params
        )
        self.prompts[request_id] = prompt

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Drop requests (running or waiting) and free their blocks; they produce no output."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish(ids, RequestStatus.FINISHED_ABORTED)
        for request_id in ids:
            self.detokenizers.pop(request_id, None)
            self.prompts.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance every running request by one step. Returns the requests that got tokens
        (streaming) or finished; with async scheduling, those of the step launched last time."""
        if self.in_flight is None:
            self.in_flight = self._launch_next()
        progressed = []
        if not self.config.scheduler.async_scheduling or self._needs_host_tokens():
            progressed = self._collect_in_flight()  # the next step is built from known tokens
        launched = self._launch_next()
        progressed += self._collect_in_flight()
        self.in_flight = launched
        if launched is not None and not self.scheduler.has_unfinished_requests():
            self._collect_in_flight()  # every request it ran has ended: drop its tokens
        return self._outputs(progressed)

    def _launch_next(self) -> tuple[SchedulerOutput, LaunchedStep] | None:
        scheduled = self.scheduler.schedule()
        launched = self.model_runner.launch(scheduled)
        return (scheduled, launched) if scheduled.requests else None

    def _collect_in_flight(self) -> list[Request]:
        if self.in_flight is None:
            return []
        scheduled, launched = self.in_flight
        self.in_flight = None
        return self.scheduler.update(scheduled, self.model_runner.collect(launched))

    def _needs_host_tokens(self) -> bool:
        """A running request's next step needs its latest token on the host (penalties count
        the output tokens when the step is built)."""
        return any(request.params.has_penalties for request in self.scheduler.running)

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

    def _validate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: LLMEngine takes one completion per request; add n requests "
                "with params.for_child(i) (LLM.generate does this)"
            )
        if not prompt_token_ids:
            raise ValueError("prompt is empty: prompt_token_ids needs at least one token")
        max_model_len = self.model_config.max_model_len
        if len(prompt_token_ids) >= max_model_len:
            raise ValueError(
                f"prompt is too long: {len(prompt_token_ids)} tokens, but max_model_len is "
                f"{max_model_len} (prompt plus at least one generated token must fit)"
            )
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains {bad[0]!r}, outside the vocabulary [0, {vocab_size})"
            )
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
