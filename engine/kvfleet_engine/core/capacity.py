"""Start-up self-benchmark: warms the engine up and measures what one replica can do.

Runs inside the engine core (the named call `measure_capacity`) before the server reports
ready. Three measurements fit a linear step time model,
step_seconds(tokens) = fixed + per_token * tokens:
- decode at two batch sizes (median step time each): the cost of one more decoding request;
- prefill: one prompt of `prefill_tokens` tokens in one step: the cost of one more prompt token.
per_token is the larger of the two slopes (the estimate errs towards slower steps). From the
model, capacity = generated tokens per second at the largest decode batch the engine runs
(max_num_seqs, or fewer if the SLA token budget is smaller): an estimate at short contexts,
which longer contexts lower. The autoscaler reads it as
`kvfleet_engine_capacity_tokens_per_second`; admission uses the model to estimate TTFT.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet_engine.core.engine_core import EngineCore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds one engine step takes for `num_tokens` scheduled tokens: fixed + per-token cost."""

    fixed_s: float  # launch/scheduling overhead of a step, seconds
    per_token_s: float  # marginal seconds per scheduled token

    def step_seconds(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens

    def max_tokens_within(self, seconds: float) -> int:
        """Largest token count whose step still fits in `seconds` (0 if none does)."""
        if seconds <= self.fixed_s:
            return 0
        return int((seconds - self.fixed_s) / max(self.per_token_s, 1e-12))


@dataclass(frozen=True)
class CapacityReport:
    step_model: StepTimeModel  # fitted step time
    decode_batches: tuple[int, ...]  # batch sizes of the decode measurements
    decode_steps_s: tuple[float, ...]  # median seconds of one decode step at each
    prefill_tokens: int  # prompt tokens in the prefill measurement
    prefill_step_s: float  # seconds of that prefill step (fastest of three)
    elapsed_s: float  # wall time of the whole self-benchmark

    def capacity_tokens_per_second(self, max_decode_batch: int) -> float:
        """Generated tokens per second with `max_decode_batch` requests decoding."""
        batch = max(1, max_decode_batch)
        return batch / self.step_model.step_seconds(batch)


def measure_capacity(
    engine: EngineCore,
    *,
    decode_batches: tuple[int, int],
    prefill_tokens: int,
    decode_steps: int = 8,
    prompt_len: int = 16,
) -> CapacityReport:
    """Warm up and measure; leaves the engine idle. Runs in the engine core, between steps."""
    from kvfleet_engine.sampling import SamplingParams

    started = time.perf_counter()
    vocab = min(engine.model_config.vocab_size, 30_000)
    # Short contexts (max_model_len 2 and up): shorter prompts, so every measurement fits.
    max_model_len = engine.model_config.max_model_len
    prompt_len = max(1, min(prompt_len, max_model_len - decode_steps - 2))
    prefill_tokens = max(1, min(prefill_tokens, max_model_len - 1))
    seeds = iter(range(1, 1_000_000))

    def prompt(length: int) -> list[int]:
        # Distinct prompts (no prefix-cache hits); ids well inside the vocabulary.
        seed = next(seeds)
        return [1 + (seed * 7919 + i * 104_729) % (vocab - 1) for i in range(length)]

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)

    def decode_step_s(batch: int) -> float:
        """Median step time once `batch` requests are all decoding."""
        for k in range(batch):
            engine.add_request(
                f"kvfleet-capacity-decode-{batch}-{k}", prompt(prompt_len), greedy(decode_steps + 2)
            )
        first_tokens: set[str] = set()
        while len(first_tokens) < batch and engine.has_unfinished_requests():
            first_tokens.update(request.request_id for request in engine.advance())
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            progressed = []
            for _ in range(engine.num_micro_batches):  # pipeline stages: one call per batch
                progressed += engine.advance()
            elapsed = time.perf_counter() - t0
            if len(progressed) == batch and not any(r.is_finished for r in progressed):
                times.append(elapsed)
        return statistics.median(times) if times else 0.0

    # Warm-up: one request through prefill and a few decodes (first-call costs).
    engine.add_request("kvfleet-warmup", prompt(prompt_len), greedy(4))
    _run_to_completion(engine)

    small, large = min(decode_batches), max(decode_batches)
    decode_small = decode_step_s(small)
    decode_large = decode_step_s(large) if large != small else decode_small

    # Prefill: one long prompt, one step, one token; on a GPU the first run of a new shape pays
    # for kernel compilation, so the fastest of three runs counts (a CPU compiles nothing).
    prefill_runs = []
    for k in range(3 if engine.model_runner.device.type == "cuda" else 1):
        engine.add_request(f"kvfleet-capacity-prefill-{k}", prompt(prefill_tokens), greedy(1))
        t0 = time.perf_counter()
        _run_to_completion(engine)
        prefill_runs.append(time.perf_counter() - t0)
    prefill_step_s = min(prefill_runs)
    # A context too short for a decode step (3 tokens or fewer): count one as long as a prefill.
    decode_small = decode_small or prefill_step_s
    decode_large = decode_large or decode_small

    slopes = [1e-9]
    if prefill_tokens > small:
        slopes.append((prefill_step_s - decode_small) / (prefill_tokens - small))
    if large > small:
        slopes.append((decode_large - decode_small) / (large - small))
    per_token = max(slopes)
    fixed = max(0.0, decode_small - per_token * small)
    report = CapacityReport(
        step_model=StepTimeModel(fixed_s=fixed, per_token_s=per_token),
        decode_batches=(small, large),
        decode_steps_s=(decode_small, decode_large),
        prefill_tokens=prefill_tokens,
        prefill_step_s=prefill_step_s,
        elapsed_s=time.perf_counter() - started,
    )
    log.info(
        "self-benchmark: decode step %.2f ms at batch %d, %.2f ms at batch %d; prefill of %d "
        "tokens %.2f ms -> step = %.3f ms + %.4f ms/token (%.1f s)",
        decode_small * 1e3,
        small,
        decode_large * 1e3,
        large,
        prefill_tokens,
        prefill_step_s * 1e3,
        fixed * 1e3,
        per_token * 1e3,
        report.elapsed_s,
    )
    return report


def _run_to_completion(engine: EngineCore) -> None:
    while engine.has_unfinished_requests():
        engine.advance()
