"""The checks a request passes before the engine core takes it (no torch: the API process
runs them too, before sending)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

from kvfleet_engine.config import ModelConfig
from kvfleet_engine.sampling import SamplingParams


def as_token_ids(prompt_token_ids: Iterable[Any]) -> list[int]:
    """The prompt as Python ints (numpy integers too); TypeError naming prompt_token_ids for a
    float, a bool or anything else that is not an integer."""
    token_ids = []
    for token in prompt_token_ids:
        if isinstance(token, bool):
            raise TypeError(f"prompt_token_ids must be int, got {token!r} (bool)")
        try:
            token_ids.append(operator.index(token))
        except TypeError:
            raise TypeError(
                f"prompt_token_ids must be int, got {token!r} ({type(token).__name__})"
            ) from None
    return token_ids


def check_priority(priority: object) -> None:
    """A request's priority is an integer (lower runs first)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be int, got {priority!r} ({type(priority).__name__})")


def validate_request(
    model_config: ModelConfig, prompt_token_ids: list[int], params: SamplingParams
) -> None:
    """Raises ValueError naming the problem when the engine cannot run this request; the API
    process checks with it before sending, the core again on arrival."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise ValueError(
            f"n={params.n}: the engine takes one completion per request; add n requests "
            "with params.for_child(i) (LLM.generate does this)"
        )
    if not prompt_token_ids:
        raise ValueError("prompt is empty: prompt_token_ids needs at least one token")
    max_model_len = model_config.max_model_len
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt is too long: {len(prompt_token_ids)} tokens, but max_model_len is "
            f"{max_model_len} (prompt plus at least one generated token must fit)"
        )
    vocab_size = model_config.vocab_size
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids contains {bad[0]!r}, outside the vocabulary [0, {vocab_size})"
        )
    bad_stops = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stops:
        raise ValueError(
            f"stop_token_ids contains {bad_stops[0]!r}, outside the vocabulary [0, {vocab_size})"
        )
