"""Programmatic dependent launch (PDL, compute capability 9.0 and newer) for the kernels of a
decode step: a kernel launched with it may be scheduled while the kernel before it in the stream
is still running, so the launch latency between the decoder layer's small kernels overlaps the
previous kernel's tail instead of following it (inside a CUDA graph on the H200: 1.38 -> 0.99 us
per small kernel, `bench/results/2026-12-03-nvidia-h200-pdl-probe.json`).

The contract, kept by `_start`: a kernel launched with PDL first waits (`griddepcontrol.wait`:
the kernels before it have finished and their writes are visible) and only then reads or writes
memory; then it lets its own successor be scheduled (`griddepcontrol.launch_dependents`). Every
such kernel waits, so finishing implies its predecessors finished too, and a kernel launched
without PDL (torch's, cuBLAS) orders as usual. A kernel takes part by calling `_start(PDL)`
before its first memory access and by being launched with `**launch_options(device)`.

One pair overlaps by it, and launches with it wherever it is `available`: the shared-prefix
kernel and, after it, a split kernel that merges its partials (`decode_attention`). That split
kernel starts with `_start(PDL, LATE_WAIT)`, walks its own context while the prefix kernel
still runs, and waits (`_late_wait`) only before reading the prefix kernel's partials. It may
read the step's other inputs before that: the prefix kernel let it launch only after its own
wait, when everything before it had finished.

Where it is on by default: for models whose linears are quantized (their products are our
Triton kernels; batch-1 fp8 +3.8%, AWQ +3.4% on the H200), not for float models, whose products
are cuBLAS's (bf16 measured 227.3 -> 219.7 tok/s with it, three rounds in one call,
`bench/results/2026-12-03-nvidia-h200-latency-llama-3.1-8b-pdl-bf16-fp8-rounds.json`). The
model runner says which (`set_default`); `KVFLEET_PDL=0` / `1` overrides it (A/B runs). The
interpreter and GPUs below 9.0 never use it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

from kvfleet_engine.kernels.int_plan import INTERPRETED

PDL_ENV = "KVFLEET_PDL"
_default = [True]  # the model runner's choice (`set_default`), where PDL_ENV does not say


def set_default(on: bool) -> None:
    """Whether kernels launch with PDL unless PDL_ENV says otherwise (the model runner: on for
    quantized linears, off for float ones)."""
    _default[0] = on
    enabled.cache_clear()


@functools.cache
def _capable(device: torch.device) -> bool:
    """Whether the device has PDL: compute capability 9.0 and newer, not the interpreter."""
    if INTERPRETED or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def available(device: torch.device) -> bool:
    """Whether PDL can be used on this device at all (`_capable`, and not PDL_ENV=0): a pair of
    kernels that overlaps by it whatever the default (`shared_prefix`) asks this. PDL_ENV is
    read on each call, so `enabled`'s cache is all a change of it needs cleared."""
    return os.environ.get(PDL_ENV, "") != "0" and _capable(device)


@functools.cache
def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL."""
    if os.environ.get(PDL_ENV, "") != "1" and not _default[0]:
        return False
    return available(device)


def launch_options(device: torch.device) -> dict[str, Any]:
    """The kernel argument PDL and, where it is on, Triton's launch option launch_pdl."""
    if enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def pair_options(device: torch.device) -> dict[str, Any]:
    """The launch options of the pair that overlaps by PDL (above) wherever it is available."""
    if available(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def _start(PDL: tl.constexpr, LATE_WAIT: tl.constexpr = False):
    """A PDL kernel's first step: wait for the kernels before it, then let the next one launch.
    LATE_WAIT: only let the next one launch; the kernel calls `_late_wait` before it reads what
    the kernel just before it writes, and reads nothing else a kernel still running writes
    (that kernel waited for everything before it at its own start: `shared_prefix`)."""
    if PDL:
        if not LATE_WAIT:
            tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _late_wait(LATE_WAIT: tl.constexpr):
    """A LATE_WAIT kernel's wait for the kernel before it (`_start`)."""
    if LATE_WAIT:
        tl.extra.cuda.gdc_wait()
