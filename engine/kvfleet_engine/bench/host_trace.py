"""`--host-trace N` of the offline benchmarks: N engine steps under torch.profiler, reported as the
device's busy share of the wall time and the host calls that took the most time — a device
synchronisation or a pinned allocation inside a step shows up here by name."""

from __future__ import annotations

import time
from typing import Any

import torch


def trace_steps(engine: Any, num_steps: int, top: int = 14) -> list[str]:
    """Run up to num_steps engine steps under the profiler, then abort what is left."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    steps = 0
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests() and steps < num_steps:
            engine.step()
            steps += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    engine.abort_request(list(engine.scheduler.requests))
    while engine.in_flight is not None:
        engine.step()
    events = prof.key_averages()
    device_s = (
        sum(
            e.self_device_time_total
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
        / 1e6
    )
    host = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: -e.self_cpu_time_total,
    )
    lines = [
        f"host trace: {steps} steps in {wall * 1e3:.1f} ms (profiled), device busy "
        f"{device_s * 1e3:.1f} ms ({device_s / wall:.0%}); host calls by self time:"
    ]
    lines += [
        f"  {e.key[:48]:<48} {e.self_cpu_time_total / 1e3:>9.2f} ms  {e.count:>6} calls"
        for e in host[:top]
    ]
    return lines
