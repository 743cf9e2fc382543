"""The sampling settings of a step's rows as device tensors, and each seeded request's own
generator (kept from its first step to its last)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from kvfleet_engine.layers.sampler import Penalties, SamplingMetadata
from kvfleet_engine.sampling import SamplingParams


class SamplingRequest(Protocol):
    """What the settings need of one sampling row (a ScheduledRequest has it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...


class SamplingInputs:
    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.generators: dict[str, torch.Generator] = {}
        self._empty = torch.empty(0, device=device)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' generators."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def metadata(self, requests: Sequence[SamplingRequest]) -> SamplingMetadata:
        """The settings of each sampling row (`requests` in row order)."""
        params = [item.params for item in requests]
        vocab_size = self.vocab_size
        generators = {}
        for row, item in enumerate(requests):
            if item.params.seed is not None and not item.params.greedy:
                generators[row] = self._generator(item.request_id, item.params.seed)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(p.greedy for p in params)
        if all_greedy and not any(p.has_penalties for p in params):
            empty = self._empty
            return SamplingMetadata(
                temperatures=empty,  # unread when every row is greedy
                top_ks=empty,
                top_ps=empty,
                min_ps=empty,
                all_greedy=True,
                generators={},
                penalties=None,
                max_num_logprobs=max(wanted) if wanted else None,
            )
        return SamplingMetadata(
            temperatures=self.tensor([p.temperature for p in params], torch.float32),
            top_ks=self.tensor(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64
            ),
            top_ps=self.tensor([p.top_p for p in params], torch.float32),
            min_ps=self.tensor([p.min_p for p in params], torch.float32),
            all_greedy=all_greedy,
            generators=generators,
            penalties=self._penalties(requests) if any(p.has_penalties for p in params) else None,
            max_num_logprobs=max(wanted) if wanted else None,
        )

    def tensor(self, data: list[Any], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def _penalties(self, requests: Sequence[SamplingRequest]) -> Penalties:
        num_rows = len(requests)
        prompt_mask = torch.zeros(num_rows, self.vocab_size, dtype=torch.bool)
        output_counts = torch.zeros(num_rows, self.vocab_size, dtype=torch.int32)
        for row, item in enumerate(requests):
            prompt_mask[row, torch.tensor(item.prompt_token_ids, dtype=torch.int64)] = True
            if item.output_token_ids:
                tokens = torch.tensor(item.output_token_ids, dtype=torch.int64)
                output_counts[row].index_add_(0, tokens, torch.ones_like(tokens, dtype=torch.int32))
        params = [item.params for item in requests]
        return Penalties(
            repetition=self.tensor([p.repetition_penalty for p in params], torch.float32),
            presence=self.tensor([p.presence_penalty for p in params], torch.float32),
            frequency=self.tensor([p.frequency_penalty for p in params], torch.float32),
            prompt_mask=prompt_mask.to(self.device),
            output_counts=output_counts.to(self.device),
        )

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        generator = self.generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.generators[request_id] = generator
        return generator
