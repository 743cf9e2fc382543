"""`SamplingParams`: how one request turns logits into tokens and when it stops."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# The largest top-n the sampler returns per token (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Validated on construction; a bad value raises ValueError naming the field."""

    # Number of completions for one prompt (LLM.generate and the server fan out).
    n: int = 1
    # 0 means greedy; otherwise logits are divided by it before sampling.
    temperature: float = 1.0
    # Keep the smallest set of tokens whose probability reaches top_p (1.0: off).
    top_p: float = 1.0
    # Keep the top_k most likely tokens (<= 0: off).
    top_k: int = -1
    # Drop tokens whose probability is below min_p times the best one's (0.0: off).
    min_p: float = 0.0
    # Seed of this request's own random generator: same seed, same tokens.
    seed: int | None = None
    # Most tokens to generate.
    max_tokens: int = 16
    # Strings that end generation; they are left out of the text.
    stop: tuple[str, ...] | list[str] = ()
    # Token ids that end generation (kept in token_ids).
    stop_token_ids: tuple[int, ...] | list[int] = ()
    # Keep generating after the end-of-sequence token.
    ignore_eos: bool = False
    # > 1 discourages tokens seen in the prompt or output (divides positive logits).
    repetition_penalty: float = 1.0
    # Subtracted once from the logit of every token already generated.
    presence_penalty: float = 0.0
    # Subtracted per occurrence from the logit of every token already generated.
    frequency_penalty: float = 0.0
    # None: no logprobs; 0: the sampled token's; k: the sampled token's and the top k.
    logprobs: int | None = None
    # Leave special tokens (e.g. end-of-sequence) out of the text.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalise list inputs so the record stays hashable and immutable.
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        object.__setattr__(
            self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int)
        )
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(
            _is_num(self.temperature) and self.temperature >= 0.0,
            "temperature",
            self.temperature,
            "a number >= 0 (0 = greedy)",
        )
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k), "top_k", self.top_k, "an integer (<= 0 disables it)")
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an integer or None")
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(all(s for s in self.stop), "stop", list(self.stop), "a list of non-empty strings")
        _check(
            _is_num(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            self.repetition_penalty,
            "a number > 0 (1.0 = off)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2.0 <= value <= 2.0, name, value, "in [-2, 2]")
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            self.logprobs,
            f"None or an integer in [0, {MAX_LOGPROBS}]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def for_child(self, index: int) -> SamplingParams:
        """Params for completion `index` of an n > 1 request: n=1, seed shifted by the index."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


def _as_tuple(field: str, value: object, kind: type) -> tuple[Any, ...]:
    if isinstance(value, str | int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, tuple | list) or not all(
        isinstance(v, kind) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"{field} must be a list of {kind.__name__}, got {value!r}")
    return tuple(value)
