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

When a kernel lets its successor launch is the mode (`mode`, `KVFLEET_PDL` = `1`, `early` or
`prefetch`): `WAIT_FIRST` after its wait, so a kernel is placed beside its predecessor's run
only; `TRIGGER_FIRST` before it, so the successor's programs are placed while the kernel before
this one still runs (its tail), and wait there; `PREFETCH` as TRIGGER_FIRST, and the one-row
products, while they wait, fetch their first weight tiles into L2 (`_prefetch_l2`): weights
are never written by a step, so reading them before the wait is safe. The pair keeps
WAIT_FIRST in every mode: its split kernel reads the step's inputs before its own wait.
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
WAIT_FIRST, TRIGGER_FIRST, PREFETCH, TAIL, WAIT_PREFETCH = 1, 2, 3, 4, 5  # the modes
MODES = {"1": WAIT_FIRST, "early": TRIGGER_FIRST, "prefetch": PREFETCH, "tail": TAIL,
         "wait-prefetch": WAIT_PREFETCH}  # fmt: skip
_TRIGGER_FIRST = tl.constexpr(TRIGGER_FIRST)  # as the kernels read them
_PREFETCH = tl.constexpr(PREFETCH)
_TAIL = tl.constexpr(TAIL)
_WAIT_PREFETCH = tl.constexpr(WAIT_PREFETCH)
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
    if os.environ.get(PDL_ENV, "") not in MODES and not _default[0]:
        return False
    return available(device)


def mode() -> int:
    """The mode kernels launch in where PDL is on (module docstring): PDL_ENV's, else
    WAIT_FIRST. A name it does not know is an error that lists the ones it does."""
    setting = os.environ.get(PDL_ENV, "")
    if setting in ("", "0"):
        return WAIT_FIRST
    if setting not in MODES:
        raise ValueError(f"{PDL_ENV}={setting!r}: expected 0 or one of {sorted(MODES)}")
    return MODES[setting]


def launch_options(device: torch.device) -> dict[str, Any]:
    """The kernel argument PDL (the mode) and, where it is on, Triton's launch option
    launch_pdl."""
    if enabled(device):
        return {"PDL": mode(), "launch_pdl": True}
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
    (that kernel waited for everything before it at its own start: `shared_prefix`; or only
    weights: `_prefetch_l2`). The mode (PDL's value) orders the other two (module docstring)."""
    if (PDL == _TAIL or PDL == _WAIT_PREFETCH) and LATE_WAIT:
        pass  # a product: `_tail_trigger` after its walk or `_after_wait`
    elif PDL:
        if (PDL >= _TRIGGER_FIRST and PDL != _WAIT_PREFETCH) or LATE_WAIT:
            tl.extra.cuda.gdc_launch_dependents()
            if not LATE_WAIT:
                tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _after_wait(PDL: tl.constexpr):
    """A product's trigger in WAIT_PREFETCH mode: prefetch, wait, then this."""
    if PDL == _WAIT_PREFETCH:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _tail_trigger(PDL: tl.constexpr):
    """A product's trigger in TAIL mode, after its K walk (its `_start` did not trigger)."""
    if PDL == _TAIL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _late_wait(LATE_WAIT: tl.constexpr):
    """A LATE_WAIT kernel's wait for the kernel before it (`_start`)."""
    if LATE_WAIT:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _prefetch_l2(lines, PREFETCHES: tl.constexpr):
    """Where PREFETCHES (a product's `PDL == _PREFETCH`, between `_start(PDL, PREFETCHES)` and
    `_late_wait(PREFETCHES)`): fetch the 128-byte lines at the pointers `lines` into L2
    without waiting for them (`prefetch.global.L2`), evicted last."""
    if PREFETCHES:
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _first_lines(words_ptr, row_start, row_last, col_start, words_per_row, ROWS: tl.constexpr,
                 COLS: tl.constexpr):  # fmt: skip
    """The 128-byte lines of a one-row product's first two [ROWS, COLS] tiles of int32 words
    (rows of words_per_row, from row_start; `_prefetch_l2`), clamped to row_last and the row."""
    LINES: tl.constexpr = COLS // 32 if COLS >= 32 else 1
    rows = tl.minimum(row_start + tl.arange(0, 2 * ROWS), row_last)
    cols = tl.minimum(col_start + tl.arange(0, LINES) * 32, words_per_row - 1)
    return words_ptr + rows[:, None].to(tl.int64) * words_per_row + cols[None, :]
