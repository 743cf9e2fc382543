"""`LLM`: offline batch generation on top of LLMEngine (the vLLM-style Python API)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.engine import LLMEngine
from kvfleet_engine.outputs import RequestOutput
from kvfleet_engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class LLM:
    """LLM(model="/models/llama", dtype="auto", device="auto", ...): keywords are those of
    EngineConfig.create (block_size, kv_cache_blocks, max_num_seqs, max_num_batched_tokens,
    max_model_len, enable_prefix_caching, ...)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - EngineConfig.keyword_names())
        if unknown:
            allowed = ", ".join(sorted(EngineConfig.keyword_names() - {"model"}))
            raise TypeError(f"LLM() got unknown keyword(s) {unknown}; allowed: {allowed}")
        self.engine = LLMEngine.from_config(EngineConfig.create(model, **kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); returns outputs in input order, each
        with n completions. Runs the engine until all of them finish."""
        texts, token_lists = self._prompts(prompts, prompt_token_ids)
        params_list = self._params(sampling_params, len(token_lists))
        priorities = list(priority) if priority is not None else [0] * len(token_lists)
        if len(priorities) != len(token_lists):
            raise ValueError(
                f"priority has {len(priorities)} entries for {len(token_lists)} prompts"
            )
        parents: list[tuple[str, list[str]]] = []
        try:
            for text, token_ids, params, prio in zip(
                texts, token_lists, params_list, priorities, strict=True
            ):
                parent_id = str(next(self._request_counter))
                child_ids = [f"{parent_id}-{i}" for i in range(params.n)]
                for index, child_id in enumerate(child_ids):
                    self.engine.add_request(
                        child_id, list(token_ids), params.for_child(index), prio, prompt=text
                    )
                parents.append((parent_id, child_ids))
        except ValueError:
            self.engine.abort_request(i for _, ids in parents for i in ids)
            raise
        finals = self._run(sum(len(ids) for _, ids in parents), use_tqdm)
        return [self._merge(parent_id, [finals[i] for i in ids]) for parent_id, ids in parents]

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        from tqdm.auto import tqdm

        finals: dict[str, RequestOutput] = {}
        engine = self.engine
        streaming, engine.stream_outputs = engine.stream_outputs, False  # finished ones only
        try:
            with tqdm(
                total=num_requests, desc="generating", unit="req", disable=not use_tqdm
            ) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finals[output.request_id] = output
                            bar.update(1)
        finally:
            engine.stream_outputs = streaming
        return finals

    @staticmethod
    def _merge(parent_id: str, children: list[RequestOutput]) -> RequestOutput:
        first = children[0]
        outputs = []
        for index, child in enumerate(children):
            completion = child.outputs[0]
            completion.index = index
            outputs.append(completion)
        return RequestOutput(
            request_id=parent_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=True,
            num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics,
        )

    def _prompts(
        self,
        prompts: str | Sequence[str] | None,
        prompt_token_ids: Sequence[Sequence[int]] | None,
    ) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            token_lists = [list(ids) for ids in prompt_token_ids]
            return [None] * len(token_lists), token_lists
        assert prompts is not None
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        tokenizer = self.engine.tokenizer
        return list(texts), [tokenizer.encode(text) for text in texts]

    @staticmethod
    def _params(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(f"sampling_params has {len(params)} entries for {num_prompts} prompts")
        return params
