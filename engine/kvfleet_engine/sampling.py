"""`SamplingParams`: how one request turns logits into tokens and when it stops."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# The largest top-n the sampler returns per token (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20
# Ranges the HTTP server's request models enforce too (server/protocol.py reads these).
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1
MAX_REPETITION_PENALTY = 10.0
# Stop token ids per request: each is sent to the engine core with every choice of the request.
MAX_STOP_TOKEN_IDS = 256
# Seeds a request generator takes: [0, 2**64 - 1] (the server's [0, 2**63 - 1] plus its per-choice
# offsets stays inside).
MAX_SEED = 2**64 - 1
# Below these the float32 sampler would overflow or underflow (NaN, token 0 forever), so they
# are raised to them: a lower temperature samples greedily (stored as 0.0); a lower top_p keeps
# only the most likely token anyway; a lower repetition_penalty divides by 1e-5.
GREEDY_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-8
MIN_REPETITION_PENALTY = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Validated on construction; a bad value raises ValueError naming the field.

    Values too small for float32 sampling are raised to a floor: a temperature below
    GREEDY_TEMPERATURE (1e-5) samples greedily and is stored as 0.0; top_p below MIN_TOP_P
    (1e-8) keeps the most likely token only, as any tiny top_p does; repetition_penalty below
    MIN_REPETITION_PENALTY (1e-5) acts as that floor."""

    # Number of completions for one prompt (LLM.generate and the server fan out).
    n: int = 1
    # In [0, 100]; 0 (or below 1e-5) means greedy; otherwise logits are divided by it.
    temperature: float = 1.0
    # Keep the smallest set of tokens whose probability reaches top_p (1.0: off).
    top_p: float = 1.0
    # Keep the top_k most likely tokens (-1 or 0: off).
    top_k: int = -1
    # Drop tokens whose probability is below min_p times the best one's (0.0: off).
    min_p: float = 0.0
    # Seed of this request's own random generator: same seed, same tokens; in [0, 2**64 - 1],
    # and completion i of n takes seed + i.
    seed: int | None = None
    # Most tokens to generate.
    max_tokens: int = 16
    # Strings that end generation; they are left out of the text.
    stop: tuple[str, ...] | list[str] = ()
    # Token ids that end generation (kept in token_ids); the engine checks them against the
    # vocabulary.
    stop_token_ids: tuple[int, ...] | list[int] = ()
    # Keep generating after the end-of-sequence token.
    ignore_eos: bool = False
    # In (0, 10]; > 1 discourages tokens seen in the prompt or output (divides positive logits).
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
        self._check_counts()
        self._check_distribution()
        self._check_penalties()
        self._raise_to_floors()

    def _check_counts(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
            "seed",
            self.seed,
            "None or an integer in [0, 2**64 - 1]",
        )
        _check(
            self.seed is None or self.seed + self.n - 1 <= MAX_SEED,
            "seed",
            self.seed,
            f"at most 2**64 - n (completion i of n={self.n} takes seed + i)",
        )
        _check(all(s for s in self.stop), "stop", list(self.stop), "a list of non-empty strings")
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            len(self.stop_token_ids),
            f"at most {MAX_STOP_TOKEN_IDS} token ids",
        )
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            list(self.stop_token_ids),
            "a list of token ids >= 0",
        )
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            self.logprobs,
            f"None or an integer in [0, {MAX_LOGPROBS}]",
        )
        for name in ("ignore_eos", "skip_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, value, "True or False")

    def _check_distribution(self) -> None:
        _check(
            _is_num(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            self.temperature,
            f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)",
        )
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(
            _is_int(self.top_k) and -1 <= self.top_k <= MAX_TOP_K,
            "top_k",
            self.top_k,
            "an integer in [-1, 2**31 - 1] (-1 or 0 disables it)",
        )
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")

    def _check_penalties(self) -> None:
        _check(
            _is_num(self.repetition_penalty)
            and 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            self.repetition_penalty,
            f"a number in (0, {MAX_REPETITION_PENALTY:g}] (1.0 = off)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2.0 <= value <= 2.0, name, value, "in [-2, 2]")

    def _raise_to_floors(self) -> None:
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "top_p", max(self.top_p, MIN_TOP_P))
        floor = max(self.repetition_penalty, MIN_REPETITION_PENALTY)
        object.__setattr__(self, "repetition_penalty", floor)

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
