"""Start-up self-benchmark: warms the engine up and measures what one replica can do.

Runs on the engine thread before the server reports ready. Two measurements fit a linear step
time model, step_seconds(tokens) = fixed + per_token * tokens:
- decode: `decode_batch` requests decoding together, median step time;
- prefill: one prompt of `prefill_tokens` tokens computed in one step.
From the model, capacity = tokens per second at the largest decode batch the engine runs
(max_num_seqs, or fewer if the SLA token budget is smaller). The autoscaler reads it as
`kvfleet_engine_capacity_tokens_per_second`; admission uses the model to estimate TTFT.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfleet_engine.server.admission import StepTimeModel

if TYPE_CHECKING:
    from kvfleet_engine.engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CapacityReport:
    step_model: StepTimeModel  # fitted step time
    decode_batch: int  # requests decoding together in the decode measurement
    decode_step_s: float  # median seconds of one decode step at that batch
    prefill_tokens: int  # prompt tokens in the prefill measurement
    prefill_step_s: float  # seconds of that prefill step
    elapsed_s: float  # wall time of the whole self-benchmark

    def capacity_tokens_per_second(self, max_decode_batch: int) -> float:
        """Generated tokens per second with `max_decode_batch` requests decoding."""
        batch = max(1, max_decode_batch)
        return batch / self.step_model.step_seconds(batch)


def measure_capacity(
    engine: LLMEngine,
    *,
    decode_batch: int,
    prefill_tokens: int,
    decode_steps: int = 8,
    prompt_len: int = 16,
) -> CapacityReport:
    """Warm up and measure; leaves the engine idle. Must run on the engine's own thread."""
    from kvfleet_engine.sampling import SamplingParams

    started = time.perf_counter()
    vocab = min(int(engine.tokenizer.vocab_size), 30_000)

    def prompt(seed: int, length: int) -> list[int]:
        # Distinct prompts (no prefix-cache hits); ids well inside the vocabulary.
        return [1 + (seed * 7919 + i * 104_729) % (vocab - 1) for i in range(length)]

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)

    # Warm-up: one request through prefill and a few decodes (first-call costs, graphs).
    engine.add_request("kvfleet-warmup", prompt(0, prompt_len), greedy(4))
    _run_to_completion(engine)

    # Decode: a batch prefills, then every step is `decode_batch` decode tokens.
    params = greedy(decode_steps + 2)
    for k in range(decode_batch):
        engine.add_request(f"kvfleet-capacity-decode-{k}", prompt(k + 1, prompt_len), params)
    first_tokens: set[str] = set()
    while len(first_tokens) < decode_batch and engine.has_unfinished_requests():
        first_tokens.update(out.request_id for out in engine.step())
    decode_times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        if len(outputs) == decode_batch and not any(out.finished for out in outputs):
            decode_times.append(elapsed)
    decode_step_s = statistics.median(decode_times) if decode_times else 0.0

    # Prefill: one long prompt, one step, one token; the first run of a new shape pays for
    # kernel compilation, so the fastest of three runs counts.
    prefill_runs = []
    for k in range(3):
        engine.add_request(
            f"kvfleet-capacity-prefill-{k}",
            prompt(decode_batch + 1 + k, prefill_tokens),
            greedy(1),
        )
        t0 = time.perf_counter()
        _run_to_completion(engine)
        prefill_runs.append(time.perf_counter() - t0)
    prefill_step_s = min(prefill_runs)

    per_token = 1e-9
    if prefill_tokens > decode_batch and prefill_step_s > decode_step_s:
        per_token = (prefill_step_s - decode_step_s) / (prefill_tokens - decode_batch)
    fixed = max(0.0, decode_step_s - per_token * decode_batch)
    report = CapacityReport(
        step_model=StepTimeModel(fixed_s=fixed, per_token_s=per_token),
        decode_batch=decode_batch,
        decode_step_s=decode_step_s,
        prefill_tokens=prefill_tokens,
        prefill_step_s=prefill_step_s,
        elapsed_s=time.perf_counter() - started,
    )
    log.info(
        "self-benchmark: decode step %.2f ms at batch %d, prefill %d tokens %.2f ms "
        "-> %.3f ms + %.4f ms/token (%.1f s)",
        decode_step_s * 1e3,
        decode_batch,
        prefill_tokens,
        prefill_step_s * 1e3,
        fixed * 1e3,
        per_token * 1e3,
        report.elapsed_s,
    )
    return report


def _run_to_completion(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
