"""Turn a batch of logits into tokens: penalties, greedy or temperature sampling with top-k /
top-p / min-p, per-request seeded generators, and logprobs of the sampled token and the top-n."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step, as tensors on the logits' device."""

    # [num_rows] float32; 0 = greedy.
    temperatures: torch.Tensor
    # [num_rows] int64; vocab size where top-k is off.
    top_ks: torch.Tensor
    # [num_rows] float32; 1.0 = off.
    top_ps: torch.Tensor
    # [num_rows] float32; 0.0 = off.
    min_ps: torch.Tensor
    # Every row is greedy: skip the sampling path.
    all_greedy: bool
    # Row -> its own generator (seeded requests); other rows use the global generator.
    generators: dict[int, torch.Generator]
    # Penalties, or None when no row has any.
    penalties: Penalties | None
    # Most top-n logprobs any row asked for; None when no row asked for logprobs.
    max_num_logprobs: int | None


@dataclass
class Penalties:
    # [num_rows] float32: > 1 discourages tokens in prompt or output.
    repetition: torch.Tensor
    # [num_rows] float32: subtracted once per token present in the output.
    presence: torch.Tensor
    # [num_rows] float32: subtracted per occurrence in the output.
    frequency: torch.Tensor
    # [num_rows, vocab] bool: token appears in the prompt.
    prompt_mask: torch.Tensor
    # [num_rows, vocab] int: occurrences in the output so far.
    output_counts: torch.Tensor


@dataclass
class SamplerOutput:
    # [num_rows] int64.
    token_ids: torch.Tensor
    # [num_rows] float32 logprob of each sampled token (None: not asked).
    sampled_logprobs: torch.Tensor | None
    # [num_rows, max_num_logprobs] ids and logprobs of the most likely tokens (None: not asked).
    top_token_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,  # [num_rows, vocab], any float dtype (cast to float32 as needed)
        meta: SamplingMetadata,
        argmax: torch.Tensor | None = None,  # [num_rows] int64 argmax of logits, if computed
    ) -> SamplerOutput:
        if not meta.all_greedy or meta.penalties is not None or meta.max_num_logprobs is not None:
            # Only these read the values; an argmax alone takes the logits' own dtype (casting
            # to float32 is exact: the same token), without a float32 copy of the vocabulary.
            logits = logits.float()
        # Logprobs describe the model's own distribution: before penalties and temperature.
        logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        if argmax is None or meta.penalties is not None:
            argmax = logits.argmax(dim=-1)
        token_ids = argmax
        if not meta.all_greedy:
            sampled = self._sample(logits, meta)
            token_ids = torch.where(meta.temperatures == 0.0, token_ids, sampled)
        if logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        sampled_logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
        top_logprobs, top_token_ids = logprobs.topk(max(meta.max_num_logprobs or 0, 1), dim=-1)
        return SamplerOutput(token_ids, sampled_logprobs, top_token_ids, top_logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temperatures = torch.where(meta.temperatures == 0.0, 1.0, meta.temperatures)
        logits = apply_top_k_top_p(logits / temperatures[:, None], meta.top_ks, meta.top_ps)
        probs = logits.softmax(dim=-1)
        probs = apply_min_p(probs, meta.min_ps)
        # Gumbel-max in exponential form: argmax(p / E), E ~ Exp(1), samples from p.
        noise = torch.empty_like(probs).exponential_()
        for row, generator in meta.generators.items():
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    seen = penalties.prompt_mask | (penalties.output_counts > 0)
    repetition = penalties.repetition[:, None]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    counts = penalties.output_counts.to(logits.dtype)
    logits = logits - penalties.frequency[:, None] * counts
    return logits - penalties.presence[:, None] * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p (nucleus) set."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_ks[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    above = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= (above >= top_ps[:, None]) & (top_ps[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below min_p times the row's largest one."""
    threshold = min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)
