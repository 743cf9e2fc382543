"""Shared by the parallelism tests: the prompts and settings every world runs (preemption,
chunked prefill, prefix hits), a free port, and the comparison of two engines' greedy
tokens that tolerates a near-tie flipped by another summation order (where the logprobs of the
two candidates agree within LOGIT_ATOL)."""

from __future__ import annotations

import socket
from typing import Any

from engine_cases import random_prompts

from kvfleet_engine import SamplingParams

LOGIT_ATOL = 1e-5
NEW_TOKENS = 12
# Small enough that the first call's 3 prompts are preempted (they need 14 blocks of 8 tokens,
# the cache has 8) and chunked (16 tokens per step), and the second call's 2 prompts start
# with prompt 1's first blocks (prefix hits).
SETTINGS: dict[str, Any] = dict(
    block_size=8, kv_cache_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64
)


def parallel_prompts() -> list[list[int]]:
    """5 prompts; the last two start with prompt 1's first 16 and 24 tokens."""
    base = random_prompts([5, 37, 20, 4, 2], seed=3)
    base[3] = base[1][:16] + base[3]
    base[4] = base[1][:24] + base[4]
    return base


def generate_twice(llm: Any) -> list[Any]:
    """Greedy, with logprobs: prompts 0-2, then 3-4 in a second call."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    first = llm.generate(
        prompt_token_ids=parallel_prompts()[:3], sampling_params=params, use_tqdm=False
    )
    # The second call finds the first call's blocks in the prefix cache.
    return first + llm.generate(
        prompt_token_ids=parallel_prompts()[3:], sampling_params=params, use_tqdm=False
    )


def free_port_pair() -> int:
    """A port p with p and p + 1 free (torch.distributed, the step channel)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return int(port)
    raise RuntimeError("no two consecutive free ports")


def assert_same_greedy(
    outputs: list[Any], references: list[Any], label: str, atol: float = LOGIT_ATOL
) -> None:
    """Token for token; at the first difference both tokens must be a tie of the reference
    (logprobs within 10 * atol), and the comparison of that sequence stops there. Every
    compared step's logprobs agree within atol."""
    for index, (out, ref) in enumerate(zip(outputs, references, strict=True)):
        got, want = out.outputs[0], ref.outputs[0]
        for step, (token, expected) in enumerate(zip(got.token_ids, want.token_ids, strict=True)):
            ours, theirs = got.logprobs[step], want.logprobs[step]
            if token != expected:
                assert token in theirs and abs(theirs[token] - theirs[expected]) < atol * 10, (
                    f"{label} prompt {index} step {step}: {token} vs {expected}, "
                    f"not a tie ({theirs})"
                )
                break
            assert abs(ours[token] - theirs[token]) < atol, (
                f"{label} prompt {index} step {step}: logprob {ours[token]} vs {theirs[token]}"
            )
        else:
            assert len(got.token_ids) == len(want.token_ids), (label, index)
