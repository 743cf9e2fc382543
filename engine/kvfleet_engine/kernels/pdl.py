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

`KVFLEET_PDL=0` turns it off (A/B runs); the interpreter and GPUs below 9.0 never use it.
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


@functools.cache
def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL."""
    if INTERPRETED or device.type != "cuda" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def launch_options(device: torch.device) -> dict[str, Any]:
    """The kernel argument PDL and, where it is on, Triton's launch option launch_pdl."""
    if enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def _start(PDL: tl.constexpr):
    """A PDL kernel's first step: wait for the kernels before it, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
