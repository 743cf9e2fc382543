"""Perplexity of the engine's model on a fixed English text, scored teacher-forced through the
engine's own model runner (paged KV cache, attention backend, quantized linears, KV-cache dtype).

Text: the values of `pydoc_data.topics.topics` (shipped with every Python) in sorted key order,
joined by newlines, tokenized with the model's tokenizer without special tokens; the first
`max_tokens` tokens are scored.

Method (Hugging Face's strided sliding window): windows of `window` tokens start every
`stride` tokens (stride < window); each window scores only the tokens no earlier window scored,
so every token but the first is scored once, with at least `window - stride` tokens of context
(all it has, near the start). A window is prefilled in chunks of `chunk` tokens into the paged
cache, each chunk attending to the earlier chunks' cached K/V (as a chunked prefill does), and
the logits of every position are taken. Perplexity = exp(mean negative log-likelihood over the
scored tokens).

The engine's public API returns sampled tokens only (no prompt logprobs), so this drives the
runner directly: KV blocks from the engine's block pool, one window at a time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvfleet_engine.request import Request
from kvfleet_engine.sampling import SamplingParams
from kvfleet_engine.step import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    # Tokens scored (every token of the text but the first).
    num_scored: int
    # Mean negative log-likelihood per scored token (nats).
    mean_nll: float


def evaluation_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def evaluation_tokens(tokenizer: Any, max_tokens: int) -> list[int]:
    """The first max_tokens tokens of evaluation_text() (no BOS or other special tokens)."""
    token_ids = list(tokenizer.encode(evaluation_text(), add_special_tokens=False))
    if len(token_ids) < max_tokens:
        raise ValueError(f"{max_tokens} tokens asked for; the evaluation text has {len(token_ids)}")
    return token_ids[:max_tokens]


def windows(num_tokens: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first_scored) per window: tokens [begin, end) are fed, and the positions
    first_scored .. end - 1 are scored (each predicted from the tokens before it)."""
    if not 0 < stride < window:
        raise ValueError(f"stride must be in [1, window={window}), got {stride}")
    scored_until = 1  # token 0 has no context
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        if end > scored_until:
            yield begin, end, scored_until
            scored_until = end
        if end == num_tokens:
            return


@torch.inference_mode()
def perplexity(
    llm: Any, token_ids: list[int], window: int, stride: int, chunk: int = 512
) -> Perplexity:
    """Perplexity of the LLM's model over token_ids (see the module docstring)."""
    if window > llm.engine.model_config.max_model_len:
        raise ValueError(
            f"window={window} exceeds the engine's max_model_len "
            f"({llm.engine.model_config.max_model_len})"
        )
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    total_nll, num_scored = 0.0, 0
    for begin, end, first_scored in windows(len(token_ids), window, stride):
        nll = _window_nll(llm.engine, token_ids[begin:end], first_scored - begin, chunk)
        total_nll += float(nll.sum())
        num_scored += nll.numel()
    mean = total_nll / num_scored
    return Perplexity(perplexity=math.exp(mean), num_scored=num_scored, mean_nll=mean)


def _window_nll(engine: Any, tokens: list[int], first_scored: int, chunk: int) -> torch.Tensor:
    """[len(tokens) - first_scored] float64: -log p(tokens[i] | tokens[:i]) for the scored i."""
    runner, kv_cache = engine.model_runner, engine.kv_cache
    params = SamplingParams(temperature=0.0, max_tokens=1)
    request = Request(request_id="perplexity", prompt_token_ids=tokens, params=params)
    if kv_cache.allocate_slots(request, len(tokens)) is None:
        raise ValueError(f"the KV cache has no room for a {len(tokens)}-token window")
    targets = torch.tensor(tokens, dtype=torch.int64, device=runner.device)
    pieces = []
    try:
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            step = ScheduledRequest(
                request_id=request.request_id,
                token_ids=piece,
                start_position=start,
                block_ids=request.block_ids,
                sample=True,
                params=params,
                prompt_token_ids=tokens,
                output_token_ids=[],
            )
            inputs = runner.prepare_inputs(SchedulerOutput([step], len(piece), frozenset()))
            every_position = torch.arange(len(piece), device=runner.device)
            inputs = dataclasses.replace(inputs, logits_indices=every_position)
            logits = runner.compute_logits(inputs)  # [len(piece), vocab] float32
            # Position p predicts token p + 1; the window's last position predicts nothing.
            predicted = targets[start + 1 : start + 1 + len(piece)]
            logprobs = torch.log_softmax(logits[: len(predicted)], dim=-1)
            pieces.append(-logprobs.gather(1, predicted[:, None])[:, 0].double())
    finally:
        kv_cache.free(request)
    nll = torch.cat(pieces)  # [len(tokens) - 1]: token i + 1's NLL at index i
    return nll[first_scored - 1 :].cpu()
