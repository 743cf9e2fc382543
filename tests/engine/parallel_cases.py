"""Shared by the parallelism tests: a free port, and the comparison of two engines' greedy
tokens that tolerates a near-tie flipped by another summation order (where the logprobs of the
two candidates agree within LOGIT_ATOL)."""

from __future__ import annotations

import socket
from typing import Any

LOGIT_ATOL = 1e-5


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
