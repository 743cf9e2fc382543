"""`bench.step_timing.StepTimer` (the offline benches' host and device split of a run): its
counts come from the engine core's own phases, and it leaves the runner as it found it."""

from __future__ import annotations

from pathlib import Path

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.bench.step_timing import StepTimer
from kvfleet_engine.tiny_model import write_tiny_model


def test_step_timer_counts_the_steps_the_engine_ran(tmp_path: Path) -> None:
    write_tiny_model(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_num_seqs=4, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # warm-up
    before = llm.engine.stats()
    with StepTimer(llm.engine) as timer:
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    after = llm.engine.stats()
    kinds = ("prefill_steps_total", "mixed_steps_total", "decode_steps_total")
    ran = sum(getattr(after, k) - getattr(before, k) for k in kinds)
    # One prompt step, then a decode step for each of the four tokens after the first.
    assert timer.steps == ran == 5
    assert timer.launch_s > 0 and timer.wait_s >= 0
    assert timer.device_seconds() == {}  # no device timeline on the CPU
    assert llm.engine.model_runner.timeline is None
