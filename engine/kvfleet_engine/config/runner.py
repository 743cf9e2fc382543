"""The model runner's settings: device, attention kernels, CUDA graphs, seed."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "sdpa", "torch", "triton")


@dataclass(frozen=True)
class RunnerConfig:
    # "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    # Paged attention implementation: auto (triton on cuda, sdpa on cpu) | sdpa | torch
    # (the plain reference) | triton.
    attention_backend: str = "auto"
    # Never capture CUDA graphs.
    enforce_eager: bool = False
    # Decode steps whose sequences all start with the same cached blocks (at least
    # SHARED_PREFIX_MIN_TOKENS) read those once per 16 sequences, not once per sequence (the
    # triton backend).
    shared_prefix_attention: bool = True
    # Seed of the global generator (requests without their own seed).
    seed: int = 0
