"""`LLM`: offline batch generation on top of LLMEngine (the vLLM-style Python API)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.validation import as_token_ids
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
        with n completions. Runs the engine until all of them finish. Bad input raises
        TypeError or ValueError naming the argument; whatever fails, this call's requests are
        aborted, so the LLM stays usable."""
        if not isinstance(use_tqdm, bool):
            raise TypeError(f"use_tqdm must be True or False, got {use_tqdm!r}")
        texts, token_lists = self._prompts(prompts, prompt_token_ids)
        params_list = self._params(sampling_params, len(token_lists))
        priorities = self._priorities(priority, len(token_lists))
        child_ids: list[str] = []
        try:
            parents = [
                self._add(text, token_ids, params, prio, child_ids)
                for text, token_ids, params, prio in zip(
                    texts, token_lists, params_list, priorities, strict=True
                )
            ]
            finals = self._run(len(child_ids), use_tqdm)
        except BaseException:
            self.engine.abort_request(child_ids)
            raise
        return [self._merge(parent_id, [finals[i] for i in ids]) for parent_id, ids in parents]

    def _add(
        self,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        added_ids: list[str],
    ) -> tuple[str, list[str]]:
        """Queue one prompt's n completions (their ids also go to `added_ids` as each is
        queued, for the abort on failure); returns the prompt's id and theirs."""
        parent_id = str(next(self._request_counter))
        child_ids = [f"{parent_id}-{i}" for i in range(params.n)]
        for index, child_id in enumerate(child_ids):
            self.engine.add_request(
                child_id, token_ids, params.for_child(index), priority, prompt=text
            )
            added_ids.append(child_id)
        return parent_id, child_ids

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
            token_lists = _token_lists(prompt_token_ids)
            return [None] * len(token_lists), token_lists
        expected = "a string or a list of strings"
        texts = [prompts] if isinstance(prompts, str) else _items(prompts, "prompts", expected)
        if not all(isinstance(text, str) for text in texts):
            raise TypeError(f"prompts must be {expected}, got {prompts!r}")
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
        expected = "a SamplingParams or a list of them (one per prompt)"
        params = _items(sampling_params, "sampling_params", expected)
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"sampling_params must be {expected}, got {sampling_params!r}")
        if len(params) != num_prompts:
            raise ValueError(f"sampling_params has {len(params)} entries for {num_prompts} prompts")
        return params

    @staticmethod
    def _priorities(priority: Sequence[int] | None, num_prompts: int) -> list[int]:
        if priority is None:
            return [0] * num_prompts
        priorities = _items(priority, "priority", "a list of ints (one per prompt)")
        for index, value in enumerate(priorities):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"priority[{index}] must be int, got {value!r}")
        if len(priorities) != num_prompts:
            raise ValueError(f"priority has {len(priorities)} entries for {num_prompts} prompts")
        return priorities


def _items(value: object, name: str, expected: str) -> list[Any]:
    """A list argument's items; TypeError naming it for a string, a mapping or a scalar."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    return list(value)


def _token_lists(prompt_token_ids: object) -> list[list[int]]:
    """One list of Python ints per prompt (from lists, tuples or arrays of integers)."""
    expected = "a list of token-id lists (one per prompt)"
    rows = _items(prompt_token_ids, "prompt_token_ids", expected)
    return [as_token_ids(_items(row, "prompt_token_ids", expected)) for row in rows]
