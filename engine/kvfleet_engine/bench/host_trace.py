"""`--host-trace N` of the offline benchmarks: N engine steps under torch.profiler, reported as the
device's busy share of the wall time and the host calls that took the most time — a device
synchronisation or a pinned allocation inside a step shows up here by name."""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

import torch


def trace_steps(
    engine: Any,
    prompts: list[list[int]],
    params: Any,
    num_steps: int,
    *,
    skip_steps: int = 0,
    top: int = 14,
) -> list[str]:
    """Queue the workload again (prefix cache emptied, so its prompts are computed, not found),
    run skip_steps steps, then up to num_steps under the profiler, then abort what is left."""
    engine.kv_cache.reset_prefix_cache()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"trace-{i}", prompt, params)
    skipped = 0
    while skipped < skip_steps and engine.has_unfinished_requests():
        engine.step()
        skipped += 1
    if not engine.has_unfinished_requests():
        while engine.in_flight is not None:
            engine.step()
        return [f"host trace: the workload ended after {skipped} steps, before any was profiled"]
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
    return lines + _device_kinds(events, steps) + _device_gaps(prof, steps) + _anatomy(prof, steps)


def _anatomy(prof: Any, steps: int) -> list[str]:
    """The device operations by their place in the model's repeating layer pattern."""
    from kvfleet_engine.bench.layer_anatomy import report

    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return report(spans, steps)


def _device_kinds(events: Any, steps: int) -> list[str]:
    """Device time per step by kind of kernel (the names bench.profile groups kernels by)."""
    from kvfleet_engine.bench.profile import kernel_kind

    by_kind: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kernel_kind(e.key)] += e.self_device_time_total / 1e3 / max(steps, 1)
    if not by_kind:
        return []
    kinds = sorted(by_kind.items(), key=lambda kv: -kv[1])
    return ["device ms per step by kind: " + ", ".join(f"{k} {v:.3f}" for k, v in kinds)]


def _device_gaps(prof: Any, steps: int, top: int = 8) -> list[str]:
    """Idle stretches of the device timeline, grouped by the operation that ended each one: the
    device work between two kernels that a step's host side or a copy made it wait for."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if len(spans) < 2:
        return []
    gaps: dict[str, list[float]] = collections.defaultdict(list)
    busy_until = spans[0][1]
    for start, end, name in spans[1:]:
        if start > busy_until:
            gaps[name[:60]].append(start - busy_until)
        busy_until = max(busy_until, end)
    total = sum(sum(v) for v in gaps.values())
    lines = [
        f"device idle between operations: {total / 1e3:.2f} ms ({total / steps:.1f} us/step), "
        "by the operation that ended it:"
    ]
    for name, values in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(
            f"  {name:<60} {sum(values) / 1e3:>8.3f} ms in {len(values):>5} gaps "
            f"(median {statistics.median(values):.1f} us)"
        )
    return lines
