"""Sampling on a pipeline's last stage: each request's settings, kept from the step diff that
first brought them until the request ends, turned into the sampler's metadata per step (with
the seeded requests' generators, which live only here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet_engine.layers.sampler import SamplingMetadata
from kvfleet_engine.parallel.messages import SamplingRow, Step
from kvfleet_engine.runner.sampling_inputs import SamplingInputs
from kvfleet_engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingItem:
    """What SamplingInputs reads of one sampling row."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class StageSampling:
    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.inputs = SamplingInputs(device, vocab_size)
        # request id -> (its settings, its prompt when it has penalties).
        self.requests: dict[str, tuple[SamplingParams, list[int]]] = {}

    def metadata(self, step: Step) -> SamplingMetadata:
        """The settings of the step's sampling rows, in row order."""
        self.inputs.drop(step.finished_request_ids)
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        items = []
        for row in step.sample_rows:
            request_id = step.request_ids[row]
            new = step.new_sampling.get(row)
            if new is not None:
                self.requests[request_id] = (_params(new), new.prompt_token_ids)
            params, prompt = self.requests[request_id]
            outputs = step.penalty_output_ids.get(row, [])
            items.append(SamplingItem(request_id, params, prompt, outputs))
        return self.inputs.metadata(items)


def _params(row: SamplingRow) -> SamplingParams:
    return SamplingParams(
        temperature=row.temperature,
        top_p=row.top_p,
        top_k=row.top_k,
        min_p=row.min_p,
        seed=row.seed,
        repetition_penalty=row.repetition_penalty,
        presence_penalty=row.presence_penalty,
        frequency_penalty=row.frequency_penalty,
        logprobs=row.logprobs,
    )
