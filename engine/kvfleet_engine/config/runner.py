"""The model runner's settings: device, attention kernels, CUDA graphs, seed."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kvfleet_engine.config.checks import check, check_switch, is_int
from kvfleet_engine.sampling import MAX_SEED

ATTENTION_BACKENDS = ("auto", "sdpa", "torch", "triton")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


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


def check_runner(runner: RunnerConfig) -> None:
    """Each setting's type and range, and a backend the device can run."""
    device, backend = runner.device, runner.attention_backend
    check(
        isinstance(device, str) and _DEVICE.fullmatch(device) is not None,
        "device",
        device,
        "auto, cpu, cuda or cuda:N",
    )
    check(
        backend in ATTENTION_BACKENDS, "attention_backend", backend, " | ".join(ATTENTION_BACKENDS)
    )
    if device == "cpu":  # "auto" is resolved where torch is imported (the executor)
        check_backend_device(backend, "cpu")
    check_switch("enforce_eager", runner.enforce_eager)
    check_switch("shared_prefix_attention", runner.shared_prefix_attention)
    seed = runner.seed
    check(is_int(seed) and 0 <= seed <= MAX_SEED, "seed", seed, "an integer in [0, 2**64 - 1]")


def check_backend_device(backend: str, device_type: str) -> None:
    """The triton backend runs on CUDA, or on the CPU under Triton's interpreter (the CPU tests
    use it; it is read once, at import, from TRITON_INTERPRET)."""
    if backend == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend 'triton' needs a CUDA device (device is {device_type!r}): use "
            "sdpa or torch on the CPU, or set TRITON_INTERPRET=1 to run the kernels interpreted"
        )
