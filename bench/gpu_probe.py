"""What the GPU probes in bench/ share: timing a launch with CUDA events, and the record each
writes (the GPU, torch's version and the command line beside the probe's own fields)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch


def time_us(launch: Callable[[], object], rounds: int = 20, warmup: int = 3) -> float:
    """Mean microseconds of one launch over `rounds` back to back, after `warmup` untimed."""
    for _ in range(warmup):
        launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        launch()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / rounds


def write_record(path: str | None, fields: dict[str, Any]) -> None:
    """The probe's fields as JSON at `path` (nothing when None), after the GPU, torch's version
    and the command that ran (PYTHONPATH=engine python bench/...)."""
    if path is None:
        return
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "PYTHONPATH=engine python " + " ".join(sys.argv),
        **fields,
    }
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1)
